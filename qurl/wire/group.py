"""A standalone weight-update process group: learner rank 0 + every engine rank.

The learner's TP ranks own the default `torch.distributed` group; the engines are other processes
(often other programs: SGLang servers). Weights therefore travel in a second, independent group
built here directly from a `TCPStore` and a `ProcessGroupGloo` (CPU) / `ProcessGroupNCCL` (GPU)
backend object. It is never registered as torch's default group, so it neither needs nor disturbs
the learner's own.

Building it by hand (rather than `torch.distributed.new_group` or the `tcp://` rendezvous) also
sidesteps torchrun's `TORCHELASTIC_USE_AGENT_STORE=True`, under which the rendezvous helper would
make *no* rank host the store and the group would never form.

Wire compatibility with SGLang (checked against sglang 0.5.23, which pins torch 2.14.1, and the
torch 2.13 installed here). An SGLang engine joins with
`sglang.srt.utils.common.init_custom_process_group(backend, init_method="tcp://addr:port",
world_size, rank=rank_offset + tp_rank, group_name)`, which does:
    store = TCPStore(addr, port, world_size, is_master=(rank == 0), multi_tenant=True)
    store = PrefixStore(group_name, store)                    # sglang
    torch `_new_process_group_helper(..., store, group_name)`:
        PrefixStore(f"{group_name}/", store)                  # torch
        PrefixStore(f"{device}/", ...)                        # torch: "cpu" for gloo, "cuda" for nccl
        ProcessGroupGloo / ProcessGroupNCCL(that store, rank, world_size)
(for a single-backend group torch builds ONE backend, for the first device: gloo -> "cpu").
`WeightGroup` builds the same chain of prefixes, so its rank 0 meets SGLang's ranks on the same
store keys. `tests/fake_sglang.py` joins through torch's own helper exactly as above, so the CPU
tests exercise this compatibility for real.

Invariants: rank 0 is always the source of every broadcast; tensors must live on the backend's
device (CPU for gloo, CUDA for nccl); every blocking call has a timeout (gloo raises on timeout
or on a dead peer rather than hanging forever).
"""
from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (the usual small race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WeightGroup:
    """One member of the weight-update group.

    host/port: the TCPStore address, hosted by rank 0 (the learner). world_size = 1 + number of
    engine ranks (an SGLang server with --tp-size T contributes T ranks). The constructor blocks
    until every rank has joined or `timeout_s` passes.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = 300.0) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: must be gloo or nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("weight group backend 'nccl' needs a CUDA device in this process")
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size, "
                             "world_size >= 2")
        if not group_name:
            raise ValueError("group_name must not be empty")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.group_name = group_name
        timeout = timedelta(seconds=timeout_s)
        try:
            self._tcp = dist.TCPStore(host, port, world_size, rank == 0, timeout,
                                      wait_for_workers=True, multi_tenant=True)
        except Exception as e:  # DistStoreError / RuntimeError: name where we tried to meet
            raise RuntimeError(f"weight group {group_name!r}: rank {rank}/{world_size} could not "
                               f"rendezvous at {host}:{port} within {timeout_s}s: {e}") from e
        store = dist.PrefixStore(group_name, self._tcp)
        store = dist.PrefixStore(f"{group_name}/", store)
        if backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            self._pg = ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, world_size, timeout)
            self.device = torch.device("cpu")
        else:
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = timeout
            self._pg = ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, world_size, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())

    def broadcast(self, tensor: torch.Tensor) -> None:
        """In-place broadcast from rank 0: rank 0 sends `tensor`, every other rank receives into it."""
        self.broadcast_async(tensor).wait()

    def broadcast_async(self, tensor: torch.Tensor):
        """Start a broadcast from rank 0; returns the backend Work (call `.wait()`)."""
        if tensor.device.type != self.device.type:
            raise ValueError(f"weight group ({self.backend}) needs {self.device.type} tensors, "
                             f"got one on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError("broadcast tensor must be contiguous")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self._pg.broadcast([tensor], opts)

    def close(self, abandon: bool = False) -> None:
        """Drop the backend and the store connection (the peers must form a new group after).

        abandon=True: a broadcast may still be in flight (a peer refused it and never joined).
        NCCL aborts it. Gloo cannot cancel one, and destroying a gloo backend blocks until its
        pending work ends (the peer leaves the group, or the group timeout passes), so the
        backend is released on a daemon thread instead: the caller goes on at once."""
        pg, self._pg = getattr(self, "_pg", None), None
        self._tcp = None
        if pg is None:
            return
        if self.backend == "nccl":
            try:
                if abandon:
                    pg.abort()
                else:
                    pg.shutdown()
            except Exception:  # already broken: nothing more to release
                pass
        if abandon:
            held = [pg]
            del pg  # the thread must hold the last reference: the destructor is what blocks
            threading.Thread(target=held.clear, daemon=True,
                             name=f"release-{self.group_name}").start()
