"""Engine side of a weight sync, for engines in our own processes (the local torch engine).

A receiver is one non-zero rank of the WeightGroup. For each sync it reads the sender's bucket
announcements (from whatever control channel the caller has: a ZeroMQ socket in the async
pipeline, a queue in tests), takes part in each broadcast, and streams the received
`(name, tensor)` chunks into `engine.load_weights(chunks, version)`. The chunks are produced
lazily bucket by bucket, so the engine applies bucket i while it is the latest one received and
the receiver never holds a second copy of the model.

It does exactly what SGLang's receiver does for the same announcement (`flattened_bucket`: one
uint8 buffer per bucket, tensors rebuilt from names/dtypes/shapes with recomputed offsets;
`per_tensor`: one broadcast per tensor in the announced order), so one Sender drives SGLang
servers and local engines in the same group.

Invariants:
- the engine's version changes only after the last bucket: `Engine.load_weights` commits after its
  iterator is exhausted, and the iterator ends right after the bucket announced `last`. The
  receiver records the engine's version at every bucket boundary (`ReceiveStats.versions_seen`)
  so this is checkable;
- announcements must arrive in order (index 0, 1, ...) with one version; anything else is a
  ValueError before any broadcast is joined for it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from qurl.engines.base import Engine
from qurl.sync.buckets import WIRE_DTYPES, unpack
from qurl.sync.group import WeightGroup
from qurl.sync.sender import BucketAnnouncement


@dataclass
class ReceiveStats:
    version: int
    buckets: int = 0
    bytes: int = 0
    recv_s: float = 0.0  # inside broadcasts
    total_s: float = 0.0  # including the engine's load
    versions_seen: list[int] = field(default_factory=list)  # engine.version at each bucket boundary


class Receiver:
    def __init__(self, group: WeightGroup, engine: Engine) -> None:
        if group.rank == 0:
            raise ValueError("Receiver cannot be rank 0 (rank 0 is the learner's Sender)")
        self.group, self.engine = group, engine

    def _recv_bucket(self, ann: BucketAnnouncement) -> list[tuple[str, torch.Tensor]]:
        device = self.group.device
        if ann.load_format == "flattened_bucket":
            buf = torch.empty(ann.layout.nbytes, dtype=torch.uint8, device=device)
            self.group.broadcast(buf)
            return unpack(buf, ann.layout)
        tensors = [(s.name, torch.empty(s.shape, dtype=WIRE_DTYPES[s.dtype], device=device))
                   for s in ann.layout.specs]
        works = [self.group.broadcast_async(t) for _, t in tensors]
        for w in works:
            w.wait()
        return tensors

    def receive(self, next_announcement: Callable[[], Any]) -> ReceiveStats:
        """Receive one whole sync. `next_announcement()` returns the next announcement, as a
        BucketAnnouncement or its `to_dict()` form; it is called once per bucket."""

        def get() -> BucketAnnouncement:
            a = next_announcement()
            return a if isinstance(a, BucketAnnouncement) else BucketAnnouncement.from_dict(a)

        first = get()
        if first.index != 0:
            raise ValueError(f"sync v{first.version}: first announcement has index {first.index}")
        stats = ReceiveStats(version=first.version)
        t_start = time.perf_counter()

        state = {"ann": first, "done": False}

        def chunks() -> Iterator[tuple[str, torch.Tensor]]:
            ann = first
            while True:
                state["ann"] = ann
                stats.versions_seen.append(self.engine.version)
                t0 = time.perf_counter()
                tensors = self._recv_bucket(ann)
                stats.recv_s += time.perf_counter() - t0
                stats.buckets += 1
                stats.bytes += ann.layout.nbytes
                yield from tensors
                if ann.last:
                    state["done"] = True
                    stats.versions_seen.append(self.engine.version)
                    return
                nxt = get()
                if nxt.version != ann.version or nxt.index != ann.index + 1:
                    raise ValueError(f"sync v{ann.version}: announcement v{nxt.version} bucket "
                                     f"{nxt.index} arrived after bucket {ann.index}")
                ann = nxt

        try:
            self.engine.load_weights(chunks(), first.version)
        except Exception:
            # The sender is still broadcasting the remaining buckets: join them (and drop the
            # data) so the group stays usable and nobody waits for a timeout, then re-raise.
            ann = state["ann"]
            try:
                while not state["done"] and not ann.last:
                    ann = get()
                    self._recv_bucket(ann)
            except Exception:  # the channel or group is broken too: report the first error
                pass
            raise
        stats.total_s = time.perf_counter() - t_start
        return stats
