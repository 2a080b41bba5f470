"""Sender-side policy of a weight sync: a delta against v-1, or everything, and what to verify.

For each version v the learner has the engine chunks (arena.py: codes, scales,
pass-throughs in their wire dtypes). `SyncPlanner.plan` decides what goes on the wire:

- a **delta** (delta.py) only when delta sync is on, the planner still holds v-1's
  chunks (the arena quantizer alternates two arenas, so they stay intact while v is built), the
  receivers are known to hold exactly v-1 (`holder` = the version and combined digest they last
  verified), and the periodic full sync is not due;
- otherwise the **full** set, with the reason: `first` (nothing to diff against: first sync,
  resumed run), `holder` (the receivers hold something else: new or restarted engine, a missed
  version, a failed or unverified sync), `periodic` (deploy.sync.full_every), `off`
  (deploy.sync.mode = full), `unsupported` (an engine that cannot apply deltas), or a reason the
  caller gives when it resyncs (`mismatch`: verification failed; `refused`: a receiver found its
  base differs).

Every plan carries the digests (digest.py) of the full version v, which the engines must
match after applying it, and a delta carries its base (v-1 and v-1's combined digest), which an
engine checks before applying anything. The planner remembers v as the next base whether or not
the send succeeds; the receivers' `holder` decides whether it can be used.

`fallbacks` counts every full sync by reason over the planner's life (cumulative, for records).

One compare pass per sync: `diff(chunks)` finds the changed positions of every tensor against the
previous version (the flip fraction is counted from them, publish.py) and `plan` reuses them
for the delta of the same chunks.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from qurl.weights.delta import Chunks, DeltaStats, diff_named, encode_named
from qurl.weights.digest import combine, named_digests
from qurl.weights.settings import SyncSettings

SYNC_MODES = ("delta", "full")


@dataclass
class SyncPlan:
    version: int
    mode: str  # "delta" | "full"
    reason: str  # why full ("" for a delta)
    chunks: Chunks  # what goes on the wire
    digests: dict[str, str]  # of version v's full chunks: what the engine must hold afterwards
    digest: str  # combine(digests)
    base: tuple[int, str] | None = None  # delta: (v-1, its combined digest)
    stats: DeltaStats = field(default_factory=DeltaStats)
    encode_s: float = 0.0
    digest_s: float = 0.0

    def header(self) -> dict[str, Any]:
        """JSON-able description the receivers need (sent with the first bucket's announcement)."""
        return {"mode": self.mode, "reason": self.reason, "version": self.version,
                "base": None if self.base is None else list(self.base),
                "digest": self.digest, "digests": self.digests}

    def metrics(self, prefix: str = "sync/") -> dict[str, float]:
        out = {f"{prefix}delta": float(self.mode == "delta"),
               f"{prefix}full_bytes": float(self.stats.full_bytes),
               f"{prefix}time_encode": self.encode_s, f"{prefix}time_digest": self.digest_s,
               f"{prefix}tensors_same": float(self.stats.same),
               f"{prefix}tensors_delta": float(self.stats.delta),
               f"{prefix}tensors_full": float(self.stats.full)}
        if self.mode == "full":
            out[f"{prefix}full_reason/{self.reason}"] = 1.0
        return out


def broadcast_chunks(plan: SyncPlan, chunks: Sequence[tuple[str, torch.Tensor]]) -> Chunks:
    """What a collective broadcast of `plan` sends: its chunks, or, for an empty delta (an
    unchanged version: a step without gradient), the smallest of the version's full `chunks`
    whole, since a broadcast needs a tensor and a delta may carry whole tensors."""
    if plan.chunks or not chunks:
        return plan.chunks
    return [min(chunks, key=lambda c: c[1].numel() * c[1].element_size())]


class SyncPlanner:
    """See the module docstring. mode: "delta" or "full"; full_every: every this many syncs one
    is full even when a delta would do (0 = never)."""

    def __init__(self, mode: str = "delta", full_every: int = 0) -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"sync mode {mode!r}: must be one of {SYNC_MODES}")
        if full_every < 0:
            raise ValueError(f"full_every must be >= 0, got {full_every}")
        self.mode, self.full_every = mode, int(full_every)
        self._prev: dict[str, torch.Tensor] | None = None
        self._prev_version: int | None = None
        self._prev_digest: str | None = None
        self._since_full = 0
        self.fallbacks: Counter[str] = Counter()
        self._diffed: tuple[Sequence, dict[str, torch.Tensor]] | None = None

    @classmethod
    def of(cls, sync: SyncSettings) -> SyncPlanner:
        """The planner of a run's sync settings (mode and full_every)."""
        return cls(sync.mode, sync.full_every)

    def diff(self, chunks: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Changed positions of `chunks` (the next version) against the last version planned,
        per tensor (qurl.weights.delta.diff_named); {} before the first. Kept for `plan(chunks)`."""
        pos = {} if self._prev is None else diff_named(self._prev, chunks)
        self._diffed = (chunks, pos)
        return pos

    @property
    def last(self) -> tuple[int, str] | None:
        """(version, combined digest) of the last version planned."""
        if self._prev_version is None or self._prev_digest is None:
            return None
        return self._prev_version, self._prev_digest

    def plan(self, chunks: Sequence[tuple[str, torch.Tensor]], version: int,
             holder: tuple[int, str | None] | None, *, can_delta: bool = True) -> SyncPlan:
        """What to send for version `version` (chunks: its full engine chunks) to receivers that
        hold `holder` = (version, combined digest they verified) (None: unknown)."""
        t0 = time.perf_counter()
        digests = named_digests(chunks)
        digest = combine(digests)
        digest_s = time.perf_counter() - t0
        reason = self._full_reason(holder, can_delta)
        if reason:
            plan = SyncPlan(version, "full", reason, list(chunks), digests, digest,
                            stats=_full_stats(chunks), digest_s=digest_s)
        else:
            t1 = time.perf_counter()
            known = self._diffed[1] if self._diffed and self._diffed[0] is chunks else None
            wire, st = encode_named(self._prev, chunks, known)
            plan = SyncPlan(version, "delta", "", wire, digests, digest,
                            base=(self._prev_version, self._prev_digest), stats=st,
                            encode_s=time.perf_counter() - t1, digest_s=digest_s)
        self._remember(chunks, version, digest, plan.mode)
        return plan

    def full(self, plan: SyncPlan, chunks: Sequence[tuple[str, torch.Tensor]], reason: str
             ) -> SyncPlan:
        """The full resync of `plan`'s version (after a mismatch or a refusal), counted."""
        self.fallbacks[reason] += 1
        self._since_full = 0
        return SyncPlan(plan.version, "full", reason, list(chunks), plan.digests, plan.digest,
                        stats=_full_stats(chunks))

    def _full_reason(self, holder: tuple[int, str | None] | None, can_delta: bool) -> str:
        if self.mode == "full":
            return "off"
        if not can_delta:
            reason = "unsupported"
        elif self._prev is None:
            reason = "first"
        elif holder is None or tuple(holder) != (self._prev_version, self._prev_digest):
            reason = "holder"
        elif self.full_every and self._since_full + 1 >= self.full_every:
            reason = "periodic"
        else:
            return ""
        self.fallbacks[reason] += 1
        return reason

    def _remember(self, chunks: Sequence[tuple[str, torch.Tensor]], version: int, digest: str,
                  mode: str) -> None:
        self._prev = dict(chunks)  # views into the quantizer's arena: intact until v+2 is built
        self._diffed = None
        self._prev_version, self._prev_digest = int(version), digest
        self._since_full = 0 if mode == "full" else self._since_full + 1

    def metrics(self, prefix: str = "sync/") -> dict[str, float]:
        """Cumulative full syncs by reason (every record carries them)."""
        return {f"{prefix}fallbacks/{k}": float(v) for k, v in sorted(self.fallbacks.items())}


def _full_stats(chunks: Sequence[tuple[str, torch.Tensor]]) -> DeltaStats:
    n = sum(t.numel() * t.element_size() for _, t in chunks)
    return DeltaStats(bytes=n, full_bytes=n, full=len(chunks))
