"""Quantizing straight into the wire buffers: one version's engine chunks, already bucketed.

A weight sync used to touch every byte three times on the learner: quantize into fresh tensors,
copy them into a bucket buffer (`pack`), broadcast the buffer. On GPUs the copy runs at HBM speed
and hardly matters; on CPU hosts it competes with the socket copies for the same cores (it was a
third of an int8 sync here). The names, shapes and dtypes of the chunks never change during a run,
so the bucket layout does not either: an *arena* computes it once and keeps one uint8 buffer per
bucket, and every version's chunks are written into views of those buffers at their wire offsets:

    version 0:   chunks = quantize_named(named)     (fresh tensors; layout = plan_buckets(chunks))
    version >0:  quantize_per_channel(w, out=(codes view, scale view)), view.copy_(w) otherwise
                 (the view in the engines' dtype for full-precision tensors: bf16 for SGLang)

The chunks handed on are those views, so a `WeightSender` with the same bucket budget finds each
bucket's tensors already in place (`buckets.bucket_buffer`) and broadcasts the buffer without
packing. (The receiving end avoids its copy the same way: receiver.py receives into
two banks of buffers and the local engine adopts them as its weights.) Anything that holds chunks across a version (the flip tracker keeps the previous codes,
an SGLang adapter keeps the last version to resend it to a restarted server) needs them intact
until the next version is in place, so `ArenaQuantizer` alternates two arenas: version v+1 never
overwrites version v.

The arenas are in host memory, pinned when CUDA is available (host.py): quantizing
runs on the weights' device and each code lands in its host view; the sender stages one bucket at
a time back onto the device for the broadcast. The learner's GPU holds no copy of the 8-bit model
between syncs (issue 59 item 5: two arenas there were ~15 GB at 7B).

A MoE layer's experts arrive per expert and are fused (qurl/quant/experts.py `fuse_experts`: one
layer's experts held at a time) into SGLang's `w13_weight` / `w2_weight`, quantized per expert.

Values are exactly `quantize_named`'s (the same functions write into the views); a weight whose
name, shape or dtype differs from the layout is a ValueError, never a silent re-layout.
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence

import torch

from qurl.quant.experts import fuse_experts, is_fused_expert, quantize_experts
from qurl.quant.formats import FORMATS, code_dtype, quantize_per_channel
from qurl.quant.named import SCALE_SUFFIX, is_quantized_linear, quantize_named, travels_as
from qurl.weights.buckets import plan_buckets, timed_items, unpack
from qurl.weights.host import host_empty

Chunks = list[tuple[str, torch.Tensor]]


class ChunkArena:
    """One uint8 buffer per bucket of `plan_buckets(chunks, budget_bytes)`, and a view per chunk;
    the buffers are in host memory (pinned when CUDA is available), wherever `chunks` are."""

    def __init__(self, chunks: Sequence[tuple[str, torch.Tensor]], budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self.order = [(n, t.dtype, tuple(t.shape)) for n, t in chunks]  # as produced
        self.views: dict[str, torch.Tensor] = {}
        self.buffers: list[torch.Tensor] = []
        for bucket in plan_buckets(chunks, self.budget_bytes):
            buf = host_empty(bucket.layout.nbytes)
            self.views.update(unpack(buf, bucket.layout))
            self.buffers.append(buf)

    def _view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        v = self.views.get(name)
        if v is None or tuple(v.shape) != tuple(shape) or v.dtype != dtype:
            got = "nothing" if v is None else f"{v.dtype} {tuple(v.shape)}"
            raise ValueError(f"{name} {dtype} {tuple(shape)}: the weight-sync layout holds {got} "
                             "under that name (weights keep their names, shapes and dtypes)")
        return v

    def fill(self, named: Iterable[tuple[str, torch.Tensor]], fmt: str, timing: list[float],
             wire_dtype: torch.dtype | None = None) -> Chunks:
        """Quantize `named` (HF names, full precision) in format `fmt` into the views (what
        passes through cast to `wire_dtype`, see `travels_as`); returns the chunks (views) in the
        order version 0 produced them. Adds to timing = [gather_s, quantize_s] (gather = waiting
        on `named`, the learner's TP gather)."""
        out: Chunks = []
        for name, w in fuse_experts(timed_items(named, timing)):
            t0 = time.perf_counter()
            if fmt in FORMATS and is_quantized_linear(name):
                codes = self._view(name, tuple(w.shape), code_dtype(fmt))  # type: ignore[arg-type]
                scale = self._view(name + SCALE_SUFFIX, (*w.shape[:-1], 1), torch.float32)
                try:
                    if is_fused_expert(name):  # a MoE layer's experts: per expert and row
                        quantize_experts(w, fmt, out=(codes, scale))
                    else:
                        quantize_per_channel(w, fmt, out=(codes, scale))  # type: ignore[arg-type]
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from err
                out += [(name, codes), (name + SCALE_SUFFIX, scale)]
            else:  # passes through (fp8_block: quantized, then copied in; copy_ casts)
                out += [(n, self._view(n, tuple(x.shape), travels_as(n, x, wire_dtype)).copy_(x))
                        for n, x in quantize_named([(name, w)], fmt)]
            timing[1] += time.perf_counter() - t0
        if [(n, t.dtype, tuple(t.shape)) for n, t in out] != self.order:
            raise ValueError(f"weight sync: {len(out)} chunks do not match the layout's "
                             f"{len(self.order)} (names or order changed)")
        return out


class ArenaQuantizer:
    """`quantize(named)` -> this version's engine chunks, laid out in wire buckets of
    `budget_bytes` (give the WeightSender's bucket budget). Alternates two arenas (module docstring).
    wire_dtype: the dtype the engines hold full-precision tensors in (None: as given)."""

    def __init__(self, fmt: str, budget_bytes: int, wire_dtype: torch.dtype | None = None) -> None:
        self.fmt, self.budget_bytes, self.wire_dtype = fmt, int(budget_bytes), wire_dtype
        self._arenas: list[ChunkArena] = []
        self._next = 0

    def quantize(self, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[Chunks, float, float]:
        """(chunks, gather_s, quantize_s) of one version."""
        timing = [0.0, 0.0]
        if len(self._arenas) < 2:  # the first two versions: quantize, lay out, copy in once
            chunks: Chunks = []
            for item in fuse_experts(timed_items(named, timing)):
                t0 = time.perf_counter()
                chunks.extend((n, x.to(travels_as(n, x, self.wire_dtype)))
                              for n, x in quantize_named([item], self.fmt))
                timing[1] += time.perf_counter() - t0
            if not chunks:
                raise ValueError("weight sync: no weights to quantize")
            t0 = time.perf_counter()
            arena = ChunkArena(chunks, self.budget_bytes)
            out = [(n, arena.views[n].copy_(t)) for n, t in chunks]
            self._arenas.append(arena)
            timing[1] += time.perf_counter() - t0
        else:
            out = self._arenas[self._next].fill(named, self.fmt, timing, self.wire_dtype)
        self._next = (self._next + 1) % 2
        return out, timing[0], timing[1]

    def sync_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The arenas' buffers (host.py `sync_memory`)."""
        return {"arenas": [b for a in self._arenas for b in a.buffers]}
