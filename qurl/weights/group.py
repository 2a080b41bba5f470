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

Which address each rank advertises. gloo tells its peers the address of the device it was built
with; left to itself (no GLOO_SOCKET_IFNAME) that is whatever the hostname resolves to, which on
many nodes, and in every network namespace, is loopback: a group spanning two nodes then fails
("connectFullMesh failed ... remote=[127.0.0.1]"). So every rank here builds its gloo device on
the address the kernel routes `host` (rank 0's rendezvous address) from — the same choice
qurl/node/netif.py makes for the learner's own ranks; GLOO_SOCKET_IFNAME, when set, still wins.
Each rank also writes what it advertised under `qurl_addr/<rank>` in the group's store: a
non-zero rank on another node that finds rank 0 advertised loopback (the mesh cannot form: it
would connect to its own loopback) raises GroupAddressError at once, and writes the reason under `qurl_fail`, which rank 0 watches
while it waits for the mesh, so both sides fail in seconds with ONE line naming every rank's
address instead of waiting out the timeout. A failed mesh names the addresses too.

NCCL settings. Before the backend forms, every member that runs this class writes its NCCL
settings (nccl_env.py: `settings`, with host and pid) to the store under
`<group_name>/qurl_nccl/`; rank 0 compares each with its own and posts a verdict the reporting
peers wait for, so a mismatch is refused by all of them in one line (`NcclMismatch`, naming both
sides) instead of hanging inside NCCL. It runs for gloo groups too (same store, same keys): the
CPU tests exercise it. Peers that do not run this class (SGLang's ranks) cannot report: rank 0 is
told its `reporters` (default: every peer), and the caller checks the others' settings from what
it launched them with (broadcaster.py `known`).

Invariants: rank 0 is always the source of every broadcast; tensors must live on the backend's
device (CPU for gloo, CUDA for nccl); every blocking call has a timeout (gloo raises on timeout
or on a dead peer rather than hanging forever).
"""
from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from qurl.weights.nccl_env import NcclMismatch, agree_over_store

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name


def _call(make) -> tuple[bool, object]:
    try:
        return True, make()
    except Exception as e:  # noqa: BLE001 - handed to the waiting thread
        return False, e


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (the usual small race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class GroupAddressError(RuntimeError):
    """The group cannot form: its ranks advertised addresses that cannot reach each other (str:
    one line naming each rank's address)."""


def route_source(host: str) -> str:
    """The local IPv4 address the kernel sends packets to `host` from (a UDP "connect" routes
    and sends nothing); qurl/node/netif.py's source_address, kept here so wire/ stays low."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def _loopback(addr: str) -> bool:
    return addr.startswith(("127.", "lo ")) or addr in ("localhost", "::1")


class WeightGroup:
    """One member of the weight-update group.

    host/port: the TCPStore address, hosted by rank 0 (the learner). world_size = 1 + number of
    engine ranks (an SGLang server with --tp-size T contributes T ranks). The constructor blocks
    until every rank has joined or `timeout_s` passes. reporters (rank 0): the peers that run this
    class and report their NCCL settings (default: all); the others are not awaited.
    NcclMismatch when a report differs from rank 0's (module docstring).
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = 300.0,
                 reporters: Iterable[int] | None = None) -> None:
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
        try:  # before the backend: a mismatch is refused here, not hung on in NCCL
            agree_over_store(dist.PrefixStore(f"{group_name}/qurl_nccl/", self._tcp), rank,
                             range(1, world_size) if reporters is None else reporters)
        except NcclMismatch:
            self._tcp = None
            raise
        store = dist.PrefixStore(group_name, self._tcp)
        store = dist.PrefixStore(f"{group_name}/", store)
        iface = os.environ.get("GLOO_SOCKET_IFNAME", "") if backend == "gloo" else \
            os.environ.get("NCCL_SOCKET_IFNAME", "")
        self.advertised = f"{iface} (*_SOCKET_IFNAME)" if iface else route_source(host)
        self._check_addresses(store, host, timeout_s)
        if backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(interface=iface) if iface else
                             ProcessGroupGloo.create_device(hostname=self.advertised)]
            self._pg = self._build(lambda: ProcessGroupGloo(dist.PrefixStore("cpu/", store),
                                                            rank, world_size, opts), store,
                                   (host, port, timeout))
            self.device = torch.device("cpu")
        else:
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            opts._timeout = timeout
            self._pg = ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, world_size, opts)
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _addresses(self, store) -> str:
        """'rank=address' of every rank that wrote one (SGLang's ranks do not: '?')."""
        out = []
        for r in range(self.world_size):
            key = f"qurl_addr/{r}"
            out.append(f"{r}={store.get(key).decode() if store.check([key]) else '?'}")
        return " ".join(out)

    def _fail_line(self, why: str, store) -> str:
        return (f"weight group {self.group_name!r} did not form: {why}; advertised "
                f"(rank=address): {self._addresses(store)}")

    def _check_addresses(self, store, host: str, timeout_s: float) -> None:
        """Write our address; a peer that advertises loopback toward a rank 0 that does not
        fails now, in one line, and tells rank 0 (module docstring)."""
        store.set(f"qurl_addr/{self.rank}", self.advertised)
        if self.rank == 0:
            return
        store.wait(["qurl_addr/0"], timedelta(seconds=timeout_s))
        head = store.get("qurl_addr/0").decode()
        if _loopback(head) and not _loopback(self.advertised):
            line = self._fail_line(f"rank 0 advertised {head}, which rank {self.rank} (at "
                                   f"{self.advertised}, another node) cannot connect to (on "
                                   "rank 0's node set GLOO_SOCKET_IFNAME to the interface "
                                   "holding its deploy.host, or unset it)", store)
            store.set("qurl_fail", line)
            raise GroupAddressError(line)

    def _build(self, make, store, where: tuple[str, int, timedelta]):
        """Rank 0: build the backend on a helper thread while watching `qurl_fail` (through a
        second store connection: the backend's blocking waits hold the first one's lock), so a
        peer that found the mesh impossible ends the wait at once; other ranks: build it."""
        if self.rank != 0:
            try:
                return make()
            except RuntimeError as e:
                raise RuntimeError(self._fail_line(str(e).splitlines()[0][:300], store)) from e
        box: list = []
        thread = threading.Thread(target=lambda: box.append(_call(make)), daemon=True,
                                  name=f"form-{self.group_name}")
        thread.start()
        host, port, timeout = where
        watch = dist.PrefixStore(f"{self.group_name}/", dist.PrefixStore(
            self.group_name, dist.TCPStore(host, port, None, False, timeout,
                                           wait_for_workers=False, multi_tenant=True)))
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive() and watch.check(["qurl_fail"]):
                raise GroupAddressError(watch.get("qurl_fail").decode())
        ok, value = box[0]
        if not ok:
            raise RuntimeError(self._fail_line(str(value).splitlines()[0][:300], store)) from value
        return value

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
