"""Weight digests: how an engine proves, after every sync, that it holds the learner's exact bits.

A delta sync (delta.py) is only correct if it lands on exactly the version it was
computed against, and any sync can go wrong in ways no exception reports (a buggy apply, memory
corrupted on the engine, a receiver that skipped a bucket). So after each sync both ends hash the
tensors, never the wire: the sender hashes the engine chunks of version v it quantized (codes,
scales, pass-throughs in their wire dtype), the engine hashes what it actually holds under the
same names, and they compare. Nothing is read back over the network: 8 bytes per tensor travel
in the last bucket's announcement (or are compared in process).

    tensor_digest(t)     BLAKE3 of t's raw bytes (C order, native little-endian), 8 bytes as hex;
                         dtype and shape are hashed too, so a reinterpretation never matches
    named_digests(named) {name: digest}; a MoE layer's fused expert tensors (codes, scales, or
                         full precision: `expert_sliced`) get one digest per
                         expert instead, under `name@expert<e>` (`digest_target` parses it back)
    combine(digests)     one digest of a whole version (names sorted), what a delta's base names

Why per expert: a kernel repack that swaps gate and up rows inside one expert of `w13_weight`
[E, 2I, H], or one expert's wrong scales, keeps every shape, dtype and byte count, so any check
over layers or tensor sizes passes; a digest of each expert's bytes names the layer and the
expert that differ (`model.layers.3.mlp.experts.w13_weight@expert5`).

A mismatch names the tensors (or expert slices) that differ; the caller resyncs in full and counts it (never trains
on the engine's output as if it held v). Cost: one pass over the weights on each end
(BLAKE3 ~1.7 GB/s per core here), reported as `sync/time_verify`.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator, Mapping

import torch
from blake3 import blake3

DIGEST_BYTES = 8
SLICE = "@expert"
# A MoE layer's fused expert tensors, [E, ...] (SGLang's FusedMoE names, qurl/quant/experts.py):
# weights, per-channel `_scale`s, block `_scale_inv`s, in every format (full precision too).
_SLICED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(w13|w2)_weight(_scale|_scale_inv)?$")


def expert_sliced(name: str) -> bool:
    """True for a tensor digested per expert (a fused expert weight or its scales)."""
    return _SLICED.match(name) is not None


def tensor_digest(t: torch.Tensor) -> str:
    """Hex digest of t's dtype, shape and bytes (t on any device; copied to CPU if needed)."""
    h = blake3(f"{t.dtype}:{tuple(t.shape)}:".encode())
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel():
        h.update(memoryview(flat.view(torch.uint8).cpu().numpy()))
    return h.hexdigest(length=DIGEST_BYTES)


def digest_entries(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """What is digested of tensor `name`: itself, or for a fused expert tensor [E, ...] each
    expert's slice t[e] under `name@expert<e>`."""
    if expert_sliced(name) and t.dim() >= 1:
        for e in range(t.shape[0]):
            yield f"{name}{SLICE}{e}", t[e]
    else:
        yield name, t


def digest_target(key: str) -> tuple[str, int | None]:
    """(tensor name, expert index or None) of a digest key made by `digest_entries`."""
    name, sep, e = key.rpartition(SLICE)
    if sep and e.isdigit() and expert_sliced(name):
        return name, int(e)
    return key, None


def named_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{digest key: digest} of every tensor (per expert slice where `digest_entries` says so)."""
    return {k: tensor_digest(x) for n, t in named for k, x in digest_entries(n, t)}


def combine(digests: Mapping[str, str]) -> str:
    """One digest of a whole version: BLAKE3 over `name=digest` lines in name order."""
    h = blake3()
    for n in sorted(digests):
        h.update(f"{n}={digests[n]}\n".encode())
    return h.hexdigest(length=DIGEST_BYTES)


def mismatches(expected: Mapping[str, str], got: Mapping[str, str]) -> list[str]:
    """Names whose digests differ or that one side lacks, sorted."""
    return sorted(n for n in set(expected) | set(got) if expected.get(n) != got.get(n))
