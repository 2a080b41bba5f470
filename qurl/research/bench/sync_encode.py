"""`qurl bench sync --delta --encode-only`: the sender's delta encode, old vs new, side by side.

A delta sync starts on the learner with the encode: compare version v1 with v0 bit for bit
(`diff_named`: the changed positions of every chunk, also the flip fraction's count) and build
the delta chunks from them (`encode_named`: low 16 bits of each position, per-64Ki-block ends,
the new values). Over a slow link the encode is the part of a delta sync that the link's speed
does not shrink, so it decides whether a delta beats a full sync there (qurl/research/bench/sync_link.py).

Two arms on the same two versions, in one process, alternating every round (best of `repeats`
after a warm-up round), so load from other jobs hits both alike:

- old: the encode as it was up to commit 0bc55ef, reimplemented here (`_old_encode`): per tensor
  an element-wise compare (numpy `not_equal` writing one boolean per element, then `flatnonzero`
  over all of them: `changed_positions_bytewise`), torch's strided copy for the low bits and
  torch's advanced indexing for the values;
- new: qurl/weights/delta.py's `diff_named` + `encode_named` (word-wise compare in cache-sized
  slices, numpy gathers).

Both arms' chunks must be equal name for name and bit for bit, or the bench fails. The versions
are qurl.research.bench.sync_delta's engine chunks at Qwen2.5 shapes (random int8 codes, fp32 scales, bf16
pass-throughs) placed in wire arenas as the learner's are (so int8 views start at any byte), v1 =
v0 with the given share of every tensor changed.
"""
from __future__ import annotations

import os
import time

import torch

from qurl.research.bench.sync_delta import FLIPS, KINDS, engine_chunks_at, perturb
from qurl.weights.arena import ChunkArena
from qurl.weights.delta import changed_positions_bytewise, delta_nbytes, diff_named, encode_named

Chunks = list[tuple[str, torch.Tensor]]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BLOCK_BITS = 16  # positions per block 2^16 and the chunk suffixes: qurl/weights/delta.py's format


def _old_diff(prev: dict[str, torch.Tensor], new: Chunks) -> dict[str, torch.Tensor]:
    return {n: changed_positions_bytewise(prev[n], t) for n, t in new
            if n in prev and prev[n].shape == t.shape and prev[n].dtype == t.dtype}


def _old_build(prev: dict[str, torch.Tensor], new: Chunks, pos: dict[str, torch.Tensor]
               ) -> Chunks:
    """encode_named's output as the old code built it (torch gathers, per tensor)."""
    out: Chunks = []
    for name, t in new:
        p = pos.get(name)
        if p is None:
            out.append((name, t))
            continue
        k, numel, item = p.numel(), t.numel(), t.element_size()
        if k == 0:
            continue
        if delta_nbytes(k, numel, item) >= numel * item:
            out.append((name, t))
            continue
        low = torch.empty(k, dtype=torch.int16)
        low.copy_(p.view(torch.int16)[::4])
        nblk = (numel + (1 << _BLOCK_BITS) - 1) >> _BLOCK_BITS
        bounds = torch.arange(1, nblk + 1, dtype=torch.int64) << _BLOCK_BITS
        ends = torch.searchsorted(p, bounds).to(torch.int32)
        vals = t.contiguous().reshape(-1).view(_INT[item])[p].view(t.dtype)
        out += [(name + "#dpos", low), (name + "#dend", ends), (name + "#dval", vals)]
    return out


def _arm(kind: str, prev: dict[str, torch.Tensor], new: Chunks) -> tuple[float, float, Chunks]:
    """(diff seconds, build seconds, chunks) of one encode of `new` against `prev`."""
    t0 = time.perf_counter()
    pos = _old_diff(prev, new) if kind == "old" else diff_named(prev, new)
    t1 = time.perf_counter()
    chunks = _old_build(prev, new, pos) if kind == "old" else encode_named(prev, new, pos)[0]
    return t1 - t0, time.perf_counter() - t1, chunks


def _same(a: Chunks, b: Chunks) -> bool:
    if [n for n, _ in a] != [n for n, _ in b]:
        return False
    for (_, x), (_, y) in zip(a, b):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.reshape(-1).view(_INT[x.element_size()]),
                           y.reshape(-1).view(_INT[y.element_size()])):
            return False
    return True


def _placed(chunks: Chunks, budget: int) -> tuple[ChunkArena, Chunks]:
    arena = ChunkArena(chunks, budget)
    return arena, [(n, arena.views[n].copy_(t)) for n, t in chunks]


def bench_encode(shapes: tuple[str, ...] = ("qwen2.5-0.5b",), flips: tuple[float, ...] = FLIPS,
                 repeats: int = 3, layers: int | None = None, bucket_mb: float = 64.0
                 ) -> list[dict]:
    """Print and return one row per (shape, flip share): best diff / build / total seconds of
    each arm and new/old (see the module docstring)."""
    load = os.getloadavg()
    print(f"encode, old vs new, best of {repeats} alternating rounds; torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} CPUs, load average at start "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)", flush=True)
    print(f"{'shape':<13} {'flips':>6} {'old diff':>8} {'old build':>9} {'old s':>6} "
          f"{'new diff':>8} {'new build':>9} {'new s':>6} {'new/old':>7}", flush=True)
    budget = int(bucket_mb * 2**20)
    rows = []
    for shape in shapes:
        arena0, v0 = _placed(engine_chunks_at(shape, layers), budget)
        prev = dict(v0)
        for f in flips:
            fresh = perturb(v0, {k: f for k in KINDS})
            arena1, v1 = _placed(fresh, budget)
            del fresh
            best = {"old": [1e9, 1e9, 1e9], "new": [1e9, 1e9, 1e9]}
            for r in range(repeats + 1):
                kept = {}
                for kind in (("old", "new") if r % 2 else ("new", "old")):
                    d, b, kept[kind] = _arm(kind, prev, v1)
                    if r:
                        best[kind] = [min(x, y) for x, y in zip(best[kind], (d, b, d + b))]
                if not _same(kept["old"], kept["new"]):
                    raise RuntimeError(f"{shape} {f:.1%}: the new encode's chunks differ from "
                                       "the old's")
                del kept
            o, n = best["old"], best["new"]
            rows.append({"shape": shape, "flips": f"{f:.1%}", "old_diff_s": o[0],
                         "old_build_s": o[1], "old_s": o[2], "new_diff_s": n[0],
                         "new_build_s": n[1], "new_s": n[2], "ratio": n[2] / o[2]})
            print(f"{shape:<13} {f:>6.1%} {o[0]:8.3f} {o[1]:9.3f} {o[2]:6.3f} {n[0]:8.3f} "
                  f"{n[1]:9.3f} {n[2]:6.3f} {n[2] / o[2]:7.3f}", flush=True)
            del arena1, v1
        del arena0, v0, prev
    load = os.getloadavg()
    print(f"load average at end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; diff: compare v1 "
          "with v0 (positions); build: the delta chunks from them; chunks of both arms checked "
          "equal bit for bit every round")
    return rows
