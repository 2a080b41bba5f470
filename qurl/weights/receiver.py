"""Engine side of a weight sync, for engines in our own processes (the local torch engine).

A receiver is one non-zero rank of the WeightGroup. For each sync it reads the sender's bucket
announcements (from whatever control channel the caller has: a ZeroMQ socket in the async
pipeline, a queue in tests), takes part in each broadcast, and streams the received
`(name, tensor)` chunks into `engine.load_weights(chunks, version)`. The chunks are produced
lazily bucket by bucket, so the engine applies bucket i while it is the latest one received and
the receiver never holds a second copy of the model.

It does exactly what SGLang's receiver does for the same announcement (`flattened_bucket`: one
uint8 buffer per bucket, tensors rebuilt from names/dtypes/shapes with recomputed offsets;
`per_tensor`: one broadcast per tensor in the announced order), so one WeightSender drives SGLang
servers and local engines in the same group.

Invariants:
- the engine's version changes only after the last bucket: `Engine.load_weights` commits after its
  iterator is exhausted, and the iterator ends right after the bucket announced `last`. The
  receiver records the engine's version at every bucket boundary (`ReceiveStats.versions_seen`)
  so this is checkable;
- announcements must arrive in order (index 0, 1, ...) with one version; anything else is a
  ValueError before any broadcast is joined for it.

Delta syncs (plan.py). The first announcement (in its dict form) may carry the sync's
header under "sync": mode, base (v-1 and its digest) and the digests of v. For a delta the
engine gets `base=` and refuses (qurl.engines.local_weights.StaleBase, before writing anything) unless it
holds exactly that base; the receiver still joins every broadcast of the sync, so the group stays
usable, and re-raises. The header comes back in `ReceiveStats.header` for the caller to verify.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from qurl.types import AdoptingEngine, Engine, verifiable
from qurl.weights.buckets import WIRE_DTYPES, unpack
from qurl.weights.group import WeightGroup
from qurl.weights.sender import BucketAnnouncement


@dataclass
class ReceiveStats:
    version: int
    buckets: int = 0
    bytes: int = 0
    recv_s: float = 0.0  # inside broadcasts
    total_s: float = 0.0  # including the engine's load
    versions_seen: list[int] = field(default_factory=list)  # engine.version at each bucket boundary
    header: dict[str, Any] | None = None  # the sync's header (delta base, digests), if sent


class WeightReceiver:
    """Rank > 0 of a WeightGroup feeding `engine`.

    Buffers (reuse_buffers=True). Flattened buckets are received into buffers kept across syncs:
    - an engine that copies each chunk before asking for the next gets a ring of 3 (bucket being
      loaded + bucket queued + bucket being received): a buffer is overwritten only after the
      engine has moved two buckets past it;
    - an engine that can *adopt* chunks (an `AdoptingEngine`, e.g. LocalEngine) gets two banks
      of one buffer per bucket: a sync is received into the bank the engine does not hold and the
      engine takes its tensors as its own at commit (no copy). The receiver moves to the other bank
      only when the engine says it adopted (`engine.adopted`), so memory the engine holds is never
      received into.
    reuse_buffers=False: a fresh buffer per bucket (the engine copies or keeps them)."""

    RING = 3  # bucket being loaded + bucket queued + bucket being received

    def __init__(self, group: WeightGroup, engine: Engine, reuse_buffers: bool = True) -> None:
        if group.rank == 0:
            raise ValueError("WeightReceiver cannot be rank 0 (rank 0 is the learner's WeightSender)")
        self.group, self.engine, self.reuse_buffers = group, engine, reuse_buffers
        self.adopt = reuse_buffers and isinstance(engine, AdoptingEngine)
        self._ring: list[torch.Tensor | None] = [None] * self.RING
        self._banks: list[list[torch.Tensor | None]] = [[], []]
        self._bank = 0  # the bank the next sync is received into

    def _buffer(self, ann: BucketAnnouncement) -> torch.Tensor:
        n, device = ann.layout.nbytes, self.group.device
        if not self.reuse_buffers:
            return torch.empty(n, dtype=torch.uint8, device=device)
        if self.adopt:
            slots, k = self._banks[self._bank], ann.index
            slots.extend([None] * (k + 1 - len(slots)))
        else:
            slots, k = self._ring, ann.index % self.RING
        buf = slots[k]
        if buf is None or buf.numel() < n:
            buf = slots[k] = torch.empty(n, dtype=torch.uint8, device=device)
        return buf[:n]

    def _recv_bucket(self, ann: BucketAnnouncement) -> list[tuple[str, torch.Tensor]]:
        device = self.group.device
        if ann.load_format == "flattened_bucket":
            buf = self._buffer(ann)
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
        BucketAnnouncement or its `to_dict()` form; it is called once per bucket.

        A background thread receives bucket i+1 while the engine loads bucket i (one bucket of
        read-ahead); the engine still sees the chunks strictly in order. `next_announcement` is
        called on that thread after the first bucket — one call at a time, while the caller is
        blocked in `receive`, so a channel it reads is never used by two threads at once. It
        should time out rather than block forever: a failed engine load waits for the remaining
        announced broadcasts (to keep the group usable) before re-raising."""

        def get() -> BucketAnnouncement:
            a = next_announcement()
            return a if isinstance(a, BucketAnnouncement) else BucketAnnouncement.from_dict(a)

        raw = next_announcement()
        header = raw.get("sync") if isinstance(raw, dict) else None
        first = raw if isinstance(raw, BucketAnnouncement) else BucketAnnouncement.from_dict(raw)
        base = _delta_base(header)
        if first.index != 0:
            raise ValueError(f"sync v{first.version}: first announcement has index {first.index}")
        stats = ReceiveStats(version=first.version, header=header)
        t_start = time.perf_counter()
        ready: queue.Queue = queue.Queue(maxsize=1)

        def fetch() -> None:  # joins every broadcast of this sync, in order, then stops
            ann = first
            try:
                while True:
                    t0 = time.perf_counter()
                    tensors = self._recv_bucket(ann)
                    stats.recv_s += time.perf_counter() - t0
                    ready.put((ann, tensors, None))
                    if ann.last:
                        return
                    nxt = get()
                    if nxt.version != ann.version or nxt.index != ann.index + 1:
                        raise ValueError(f"sync v{ann.version}: announcement v{nxt.version} "
                                         f"bucket {nxt.index} arrived after bucket {ann.index}")
                    ann = nxt
            except BaseException as e:  # hand the error to the consumer
                ready.put((None, None, e))

        thread = threading.Thread(target=fetch, name="qurl-sync-recv", daemon=True)
        thread.start()

        def chunks() -> Iterator[tuple[str, torch.Tensor]]:
            while True:
                stats.versions_seen.append(self.engine.version)
                ann, tensors, err = ready.get()
                if err is not None:
                    raise err
                stats.buckets += 1
                stats.bytes += ann.layout.nbytes
                yield from tensors
                if ann.last:
                    stats.versions_seen.append(self.engine.version)
                    return

        extra: dict[str, Any] = {} if base is None else {"base": base}
        try:
            if base is not None and verifiable(self.engine) is None:
                raise ValueError(f"sync v{first.version} is a delta and this engine cannot "
                                 "apply deltas")
            if self.adopt:
                assert isinstance(self.engine, AdoptingEngine)
                self.engine.load_weights(chunks(), first.version, adopt=True, **extra)
                if self.engine.adopted:
                    self._bank ^= 1  # the engine holds this bank now; the next sync uses the other
            else:
                self.engine.load_weights(chunks(), first.version, **extra)
        finally:
            # If the engine failed, the fetch thread still joins the remaining broadcasts (the
            # sender is sending them); drain it so the group stays usable, then re-raise.
            while thread.is_alive():
                try:
                    ready.get(timeout=0.1)
                except queue.Empty:
                    pass
            thread.join()
        stats.total_s = time.perf_counter() - t_start
        return stats


def _delta_base(header: Any) -> tuple[int, str] | None:
    """(v-1, digest) of a delta sync's header; None for a full sync or no header."""
    if header is None:
        return None
    if not isinstance(header, dict) or header.get("mode") not in ("delta", "full"):
        raise ValueError(f"sync header: bad mode in {header!r:.120}")
    if header["mode"] == "full":
        return None
    base = header.get("base")
    if not (isinstance(base, (list, tuple)) and len(base) == 2 and isinstance(base[0], int)
            and isinstance(base[1], str)):
        raise ValueError(f"sync header: a delta needs base [version, digest], got {base!r:.80}")
    return int(base[0]), base[1]
