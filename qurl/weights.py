"""In-process weight sync: learner master weights -> 8-bit codes + scales -> engine, with flip fraction.

This is the synchronous path (learner and engine in one process). The learner's master weights
already carry UAQ's invariant scaling, so quantizing them directly gives the grid the engine uses.
The flip fraction — the share of 8-bit codes that changed since the previous sync — is measured here
on the exact codes sent, split into the layers UAQ scales (q/k/v/gate/up) and the others.
"""
from __future__ import annotations

import time
from typing import Iterable

import torch

from qurl.engines.base import Engine
from qurl.quant.flips import flip_fractions
from qurl.quant.named import NAMED_FORMATS, quantize_named


class FlipTracker:
    """Flip fraction between consecutive syncs, from the exact 8-bit codes sent."""

    def __init__(self) -> None:
        self._prev_codes: dict[str, torch.Tensor] = {}

    def update(self, chunks: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        codes = {n: t for n, t in chunks if t.dtype in (torch.int8, torch.float8_e4m3fn)}
        stats: dict[str, float] = {}
        if self._prev_codes and codes:
            flips = flip_fractions(self._prev_codes, codes)
            stats = {"flip_frac": flips["all"], "flip_frac/uaq_scaled": flips["uaq_scaled"],
                     "flip_frac/unscaled": flips["unscaled"]}
        self._prev_codes = codes
        return stats


class WeightSync:
    def __init__(self, precision: str) -> None:
        if precision not in NAMED_FORMATS:
            raise ValueError(f"precision={precision!r}: must be one of {', '.join(NAMED_FORMATS)}")
        self.precision = precision
        self.flips = FlipTracker()

    def push(self, named: Iterable[tuple[str, torch.Tensor]], engine: Engine | None,
             version: int) -> dict[str, float]:
        """Quantize and load one version into `engine`. `named` must be consumed on every TP rank
        (it is a collective); ranks without an engine pass engine=None."""
        t0 = time.perf_counter()
        chunks = list(quantize_named(named, self.precision))
        t1 = time.perf_counter()
        if engine is None:
            return {}
        engine.load_weights(iter(chunks), version)
        t2 = time.perf_counter()
        stats = {"sync/time_quantize": t1 - t0, "sync/time_load": t2 - t1,
                 "sync/bytes": float(sum(t.numel() * t.element_size() for _, t in chunks))}
        stats.update(self.flips.update(chunks))
        return stats
