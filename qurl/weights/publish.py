"""In-process weight sync: learner master weights -> 8-bit codes + scales -> engine, with flip fraction.

This is the synchronous path (learner and engine in one process). The learner's master weights
already carry UAQ's invariant scaling, so quantizing them directly gives the grid the engine uses.
The flip fraction — the share of 8-bit codes that changed since the previous sync — is measured here
on the exact codes sent, split into the layers UAQ scales (q/k/v/gate/up) and the others.

Each version goes as a delta against the previous one when the engine holds it verified, else in
full (plan.py), and the engine then proves it holds the sender's bits (digest.py:
`verify`); a refused delta or a mismatch is resynced in full at once and counted, and a second
mismatch stops the run with one line naming the engine and the tensors (`unverified`, a RunHalted:
`qurl train` prints it and exits 2; the run resumes from its last checkpoint): the loop never
samples from weights that differ from the learner's. That rule is resync.py
`ResyncRule`, the same one the async fleet applies to each worker (qurl/pipeline/fleet.py).
Engines without `verify` (an SGLang engine whose servers lack qurl's sync loader, or run TP > 1
with a cut qurl cannot map: qurl/engines/sglang/verified_sync.py) get full syncs (`unsupported`)
and records say `sync/verified` = NaN (not checked).
"""
from __future__ import annotations

import time
from typing import Iterable

import torch

from qurl.types import Engine, StaleBase, verifiable
from qurl.quant.flips import aggregate_flips
from qurl.quant.named import NAMED_FORMATS
from qurl.weights.arena import ArenaQuantizer
from qurl.weights.plan import SyncPlanner
from qurl.weights.resync import ACCEPT, MISMATCH, OK, REFUSED, ResyncRule, engine_label
from qurl.weights.settings import SyncSettings

CODES = (torch.int8, torch.float8_e4m3fn)


class WeightSync:
    """Quantize (into wire-bucket arenas, see arena.py) and load each version."""

    def __init__(self, precision: str, bucket_bytes: int = 64 << 20,
                 wire_dtype: torch.dtype | None = None, mode: str = "delta",
                 full_every: int = 0) -> None:
        """wire_dtype: the dtype the engine holds full-precision tensors in (None: the masters').
        bucket_bytes / mode / full_every: a run's come from its `SyncSettings` (`of`;
        settings.py, plan.py)."""
        if precision not in NAMED_FORMATS:
            raise ValueError(f"precision={precision!r}: must be one of {', '.join(NAMED_FORMATS)}")
        self.precision = precision
        self.quantizer = ArenaQuantizer(precision, bucket_bytes, wire_dtype)
        self.planner = SyncPlanner(mode, full_every)
        self.resync = ResyncRule()  # what follows each load: accept, resend in full, or halt

    @classmethod
    def of(cls, precision: str, sync: SyncSettings,
           wire_dtype: torch.dtype | None = None) -> WeightSync:
        """A run's weight sync: rollout.precision, its `[deploy.sync]` settings (bucket size, delta
        or full, periodic full syncs) and the engines' wire dtype
        (qurl.engines.factory.engine_wire_dtype)."""
        return cls(precision, sync.bucket_bytes, wire_dtype, mode=sync.mode,
                   full_every=sync.full_every)

    def sync_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this sync keeps between versions: its arenas (host.py `sync_memory`)."""
        return self.quantizer.sync_tensors()

    def quantize(self, named: Iterable[tuple[str, torch.Tensor]],
                 ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, float]]:
        """Gather (a collective on every TP rank) and quantize one version into wire chunks;
        stats: gather / quantize seconds and the flip fraction since the previous version."""
        chunks, gather_s, quant_s = self.quantizer.quantize(named)
        stats = {"sync/time_gather": gather_s, "sync/time_quantize": quant_s}
        t0 = time.perf_counter()
        # the flip fraction, from the exact codes sent; the same compare feeds the delta
        changed = self.planner.diff(chunks if self.planner.mode == "delta" else
                                    [(n, t) for n, t in chunks if t.dtype in CODES])
        flips = aggregate_flips({n: p.numel() for n, p in changed.items()},
                                {n: t.numel() for n, t in chunks})
        if flips:
            stats.update({"flip_frac": flips["all"], "flip_frac/uaq_scaled": flips["uaq_scaled"],
                          "flip_frac/unscaled": flips["unscaled"]})
        stats["sync/time_diff"] = time.perf_counter() - t0
        return chunks, stats

    def push(self, named: Iterable[tuple[str, torch.Tensor]], engine: Engine | None,
             version: int) -> dict[str, float]:
        """Quantize and load one version into `engine`, as a delta when it can take one, and
        verify it (module docstring). `named` must be consumed on every TP rank (it is a
        collective); ranks without an engine pass engine=None and quantize nothing."""
        if engine is None:
            for _ in named:
                pass
            return {}
        chunks, stats = self.quantize(named)
        checked = verifiable(engine)
        holder = (engine.version, checked.digest if checked else None)
        plan = first = self.planner.plan(chunks, version, holder, can_delta=checked is not None)
        t1 = time.perf_counter()
        try:
            self._load(engine, plan)
            refused = False
        except StaleBase:
            refused = True
        # an engine may find at its first load that it cannot verify (an SGLang TP > 1 server
        # whose cut qurl cannot map: qurl/engines/sglang/verified_sync.py `tp_refusal`)
        checked = verifiable(engine)
        load_s, verify_s, mismatched, verified = time.perf_counter() - t1, 0.0, 0.0, float("nan")
        sent = plan.stats.bytes
        key, who = id(engine), engine_label(engine)  # this engine, to the rule and in its error
        if refused:  # the rule's answer to a refusal is always: the whole version
            plan = self.planner.full(plan, chunks, self.resync.decide(key, REFUSED).reason)
            self._load(engine, plan)
            sent += plan.stats.bytes
        if checked is not None:
            t2 = time.perf_counter()
            bad = checked.verify(plan.digests)
            verified, mismatched = (0.0, float(len(bad))) if bad else (1.0, 0.0)
            # never sample from weights that differ from the learner's (resync.py):
            # a mismatch is resynced in full and checked again, a second one halts the run
            while (decision := self.resync.decide(key, MISMATCH if bad else OK, version=version,
                                                  bad=bad, who=who)).action != ACCEPT:
                if decision.error is not None:
                    raise decision.error
                plan = self.planner.full(plan, chunks, decision.reason)
                self._load(engine, plan)
                sent += plan.stats.bytes
                bad = checked.verify(plan.digests)
            verify_s = time.perf_counter() - t2
        stats.update(first.metrics())  # what was tried; a resync is counted apart
        if plan is not first:
            stats[f"sync/resync/{plan.reason}"] = 1.0
        stats.update(self.planner.metrics())
        stats.update({"sync/time_load": load_s, "sync/time_verify": verify_s,
                      "sync/bytes": float(sent),
                      "sync/verified": verified,
                      "sync/verify_mismatches": mismatched})
        return stats

    @staticmethod
    def _load(engine: Engine, plan) -> None:
        if plan.base is None:
            engine.load_weights(iter(plan.chunks), plan.version)
        else:
            engine.load_weights(iter(plan.chunks), plan.version, base=plan.base)  # type: ignore[call-arg]
