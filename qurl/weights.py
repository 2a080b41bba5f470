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
from qurl.quant.named import NAMED_FORMATS
from qurl.sync.arena import ArenaQuantizer


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
    """Quantize (into wire-bucket arenas, see qurl/sync/arena.py) and load each version."""

    def __init__(self, precision: str, bucket_bytes: int = 64 << 20,
                 wire_dtype: torch.dtype | None = None) -> None:
        """wire_dtype: the dtype the engine holds full-precision tensors in (None: the masters')."""
        if precision not in NAMED_FORMATS:
            raise ValueError(f"precision={precision!r}: must be one of {', '.join(NAMED_FORMATS)}")
        self.precision = precision
        self.quantizer = ArenaQuantizer(precision, bucket_bytes, wire_dtype)
        self.flips = FlipTracker()

    def quantize(self, named: Iterable[tuple[str, torch.Tensor]],
                 ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, float]]:
        """Gather (a collective on every TP rank) and quantize one version into wire chunks;
        stats: gather / quantize seconds and the flip fraction since the previous version."""
        chunks, gather_s, quant_s = self.quantizer.quantize(named)
        stats = {"sync/time_gather": gather_s, "sync/time_quantize": quant_s}
        stats.update(self.flips.update(chunks))
        return chunks, stats

    def push(self, named: Iterable[tuple[str, torch.Tensor]], engine: Engine | None,
             version: int) -> dict[str, float]:
        """Quantize and load one version into `engine`. `named` must be consumed on every TP rank
        (it is a collective); ranks without an engine pass engine=None and quantize nothing."""
        if engine is None:
            for _ in named:
                pass
            return {}
        chunks, stats = self.quantize(named)
        t1 = time.perf_counter()
        engine.load_weights(iter(chunks), version)
        stats.update({"sync/time_load": time.perf_counter() - t1,
                      "sync/bytes": float(sum(t.numel() * t.element_size() for _, t in chunks))})
        return stats
