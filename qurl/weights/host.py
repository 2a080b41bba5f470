"""Where the weight sync keeps its copies of the 8-bit model: host memory, never the learner's GPU.

Learner rank 0 holds up to three copies of the engine chunks between syncs: the two arenas the
quantizer alternates (arena.py: version v+1 must not overwrite v while the delta
planner and flip tracker read it) and an SGLang adapter's kept copy (qurl/engines/sglang/
verified_sync.py: what a restarted server is resent). At 7B that is ~3 x 7.6 GB; on the
learner's GPU it came out of the memory the learner needs for long rows (issue 59 item 5). So
they live in host memory, PINNED when CUDA is available (page-locked: the host -> device copy
runs at full PCIe speed and asynchronously), plain on a CPU-only host (pinning needs a CUDA
context). The broadcast stages one bucket at a time onto the device (sender.py: two
bucket-sized device buffers, bucket i+1 copied in while bucket i is on the wire), so the device
holds 2 x deploy.sync.bucket_mb of sync memory instead of the model three times.

`sync_memory` is the measurement hook: bytes per place ("cuda", "cpu_pinned", "cpu") of every
holder's tensors (each storage counted once), for anything implementing `HoldsSyncMemory`
(ArenaQuantizer, WeightSync, WeightSender, SGLangEngine). The GPU check calls it to show that
the sync path holds only the staging buffers on the device.
"""
from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch


def pin_host() -> bool:
    """Whether host copies are pinned: only where CUDA is available (module docstring)."""
    return torch.cuda.is_available()


def host_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 [nbytes] buffer in host memory (pinned when CUDA is available)."""
    return torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=pin_host())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory (pinned when CUDA is available), same dtype and shape."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin_host())
    return out.copy_(t.detach())


def place(t: torch.Tensor) -> str:
    """"cuda", "cpu_pinned" or "cpu" (or another device type's name)."""
    if t.device.type == "cpu":
        return "cpu_pinned" if t.is_pinned() else "cpu"
    return t.device.type


@runtime_checkable
class HoldsSyncMemory(Protocol):
    """Something on the sync path that keeps tensors between syncs."""

    def sync_tensors(self) -> dict[str, list[torch.Tensor]]:
        """{what (e.g. "arenas", "kept", "staging"): the tensors held for it}."""


def sync_memory(*holders: HoldsSyncMemory | None) -> dict[str, dict[str, int]]:
    """{what: {place: bytes}} over every holder (None skipped), each storage counted once, plus
    "total": {place: bytes}. Device bytes of the sync path = result["total"].get("cuda", 0)."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, dict[str, int]] = {}
    total: dict[str, int] = {}
    for h in holders:
        if h is None:
            continue
        for what, tensors in h.sync_tensors().items():
            row = out.setdefault(what, {})
            for t in _storages(tensors):
                key = (str(t.device), t.untyped_storage().data_ptr())
                if key in seen:
                    continue
                seen.add(key)
                nbytes = t.untyped_storage().nbytes()
                row[place(t)] = row.get(place(t), 0) + nbytes
                total[place(t)] = total.get(place(t), 0) + nbytes
    out["total"] = total
    return out


def _storages(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    return (t for t in tensors if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes())
