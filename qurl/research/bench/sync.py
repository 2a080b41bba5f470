"""`qurl bench sync`: weight-sync throughput against a raw gloo broadcast of the same bytes, and
bytes per sync for int8 vs bf16, measured side by side in one run.

Setup: this process is the learner (rank 0); one spawned process is an engine-side receiver
(rank 1) in a two-rank gloo WeightGroup on loopback. The weights are a synthetic named set with
HF Qwen2 names and the shapes of the `small` preset (~104M parameters) or of Qwen2.5-0.5B
(`--shapes qwen2.5-0.5b`, ~494M): fp32 master weights, random values (the values do not change
the cost), so the bench needs no model files.

Measured per format (int8, bf16), after one warm-up:
- bytes per sync (8-bit codes + fp32 scales + bf16 for what stays full precision, vs all bf16);
- sync: a WeightSender moving the already-quantized engine chunks, laid out in their wire buckets as the
  pipeline's quantizer writes them (qurl/weights/arena.py: no packing copy): announcements,
  broadcasts, and the receiver validating every chunk and adopting it as the engine's tensor (as
  LocalEngine does with the receiver's double-banked buffers: no copy) and acking after the last
  bucket; `copy/raw` is the same with an engine that copies every chunk into its own tensors,
  `packed/raw` that plus chunks in separate tensors the WeightSender first copies into a send buffer;
- raw: pre-filled uint8 buffers of the same bucket sizes broadcast back to back, nothing else;
  `sync/raw` is the share of the raw broadcast rate the sync achieves; `no-apply/raw` the same
  when the receiver drops the chunks instead of copying them into the engine (transport only);
- quantize: producing the chunks from fp32 master weights into fresh tensors; e2e: the pipeline's
  whole sync from fp32 (ArenaQuantizer writing into the wire buckets, then the sync).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import torch

from qurl.config import DeployConfig
from qurl.learner.dist import free_port
from qurl.quant.formats import all_finite
from qurl.quant.named import engine_chunks
from qurl.weights.arena import ArenaQuantizer, ChunkArena
from qurl.weights.group import WeightGroup
from qurl.weights.receiver import WeightReceiver
from qurl.weights.sender import WeightSender

# Synthetic shapes: qurl's `small` preset (~104M) and Qwen2.5-0.5B's (~494M, tied embeddings).
SHAPES = {"small": dict(hidden=768, layers=12, heads=12, kv_heads=4, ffn=3072, vocab=384),
          "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936)}


def synthetic_named(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                    seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """HF Qwen2 names and shapes (tied embeddings), random fp32 values."""
    g = torch.Generator().manual_seed(seed)
    kv = hidden // heads * kv_heads
    out = [("model.embed_tokens.weight", torch.randn(vocab, hidden, generator=g))]
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("input_layernorm.weight", (hidden,)),
                            ("self_attn.q_proj.weight", (hidden, hidden)),
                            ("self_attn.q_proj.bias", (hidden,)),
                            ("self_attn.k_proj.weight", (kv, hidden)),
                            ("self_attn.k_proj.bias", (kv,)),
                            ("self_attn.v_proj.weight", (kv, hidden)),
                            ("self_attn.v_proj.bias", (kv,)),
                            ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("post_attention_layernorm.weight", (hidden,)),
                            ("mlp.gate_proj.weight", (ffn, hidden)),
                            ("mlp.up_proj.weight", (ffn, hidden)),
                            ("mlp.down_proj.weight", (hidden, ffn))):
            out.append((p + name, torch.randn(*shape, generator=g) * 0.02))
    out.append(("model.norm.weight", torch.ones(hidden)))
    return out


class _SinkEngine:
    """Engine-side stand-in for the bench. apply=True: takes every chunk as an engine that adopts
    its receive buffers does (LocalEngine: validated, then kept as its tensor, no copy); with
    copy=True it copies every chunk into a preallocated tensor instead (an engine that cannot
    adopt); apply=False: drops the chunks (transport only)."""

    adopts_chunks = True

    def __init__(self) -> None:
        self.version = 0
        self.apply, self.copy, self.adopted = True, False, False
        self.tensors: dict[str, torch.Tensor] = {}

    def load_weights(self, chunks, version: int, adopt: bool = False) -> None:
        for name, t in chunks:
            if not self.apply:
                continue
            if t.is_floating_point() and t.dtype != torch.float8_e4m3fn and not all_finite(t):
                raise ValueError(f"{name}: contains NaN or inf")
            dst = self.tensors.get(name)
            if adopt and not self.copy:
                self.tensors[name] = t
                continue
            if dst is None or dst.shape != t.shape or dst.dtype != t.dtype:
                dst = self.tensors[name] = torch.empty_like(t)
            dst.copy_(t)
        self.adopted = adopt and self.apply and not self.copy
        self.version = version


def _receiver(port: int, ctl: Any, ann_q: Any, ack_q: Any) -> None:

    group = WeightGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=300)
    sink = _SinkEngine()
    rec = WeightReceiver(group, sink)  # type: ignore[arg-type]
    raw_bufs: dict[tuple[int, ...], list[torch.Tensor]] = {}
    while True:
        cmd = ctl.get()
        if cmd[0] == "raw":  # buffers kept across repeats: the baseline pays no page faults
            bufs = raw_bufs.setdefault(tuple(cmd[1]),
                                       [torch.empty(n, dtype=torch.uint8) for n in cmd[1]])
            for b in bufs:
                group.broadcast(b)
            ack_q.put("raw")
        elif cmd[0] == "sync":
            sink.apply, sink.copy = cmd[1], cmd[2]
            rec.receive(lambda: ann_q.get(timeout=300))
            ack_q.put("sync")
        else:
            group.close()
            return


def _mb(x: float) -> str:
    return f"{x / 2**20:9.1f}"


def bench_sync(bucket_mb: float | None = None, repeats: int = 5, shapes: str = "small") -> dict:
    """Run the bench on the synthetic weights SHAPES[shapes], print a table, return the numbers
    (seconds are the best of `repeats`, after one warm-up; sync and raw runs alternate so load
    drift hits both alike; quantize is one pass)."""
    if shapes not in SHAPES:
        raise ValueError(f"shapes={shapes!r}: must be one of {', '.join(SHAPES)}")
    if bucket_mb is None:
        bucket_mb = DeployConfig().sync.bucket_mb
    named = synthetic_named(**SHAPES[shapes])
    n_params = sum(t.numel() for _, t in named)
    ctx = mp.get_context("spawn")
    ctl, ann_q, ack_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_receiver, args=(port, ctl, ann_q, ack_q), daemon=True)
    proc.start()
    results: dict[str, dict[str, float]] = {}
    budget = int(bucket_mb * 2**20)
    try:
        group = WeightGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=300)
        sizes: list[int] = []

        def announce(a):
            sizes.append(a.layout.nbytes)
            ann_q.put(a.to_dict())
            return (lambda: ack_q.get(timeout=300)) if a.last else None

        def sync(sender: WeightSender, data, apply: bool = True, copy: bool = False) -> float:
            sizes.clear()
            ctl.put(("sync", apply, copy))
            return sender.send(data, version=1, announce=announce).total_s

        def raw(bufs: list[torch.Tensor]) -> float:
            ctl.put(("raw", [b.numel() for b in bufs]))
            t0 = time.perf_counter()
            for b in bufs:
                group.broadcast(b)
            ack_q.get(timeout=300)
            return time.perf_counter() - t0

        for fmt in ("int8", "bf16"):
            t0 = time.perf_counter()
            loose = list(engine_chunks(named, fmt, wire_dtype=torch.bfloat16))
            quant_s = time.perf_counter() - t0
            arena = ChunkArena(loose, budget)  # the same chunks, laid out in wire buckets
            placed = [(n, arena.views[n].copy_(t)) for n, t in loose]
            sender = WeightSender(group, bucket_bytes=budget)  # chunks already 8-bit
            # what the pipeline runs for SGLang engines, from fp32 (the same chunks and layout)
            quantizer = ArenaQuantizer(fmt, budget, wire_dtype=torch.bfloat16)
            for _ in range(2):  # warm-up (builds the quantizer's two arenas)
                sync(sender, quantizer.quantize(named)[0])
            sync(sender, placed)  # warm-up; records the bucket sizes
            bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
            raw(bufs)
            sync_s, copy_s, packed_s, bare_s, raw_s, e2e_s = [], [], [], [], [], []
            for _ in range(repeats):
                sync_s.append(sync(sender, placed))
                raw_s.append(raw(bufs))
                bare_s.append(sync(sender, placed, apply=False))
                copy_s.append(sync(sender, placed, copy=True))
                packed_s.append(sync(sender, loose, copy=True))
                t0 = time.perf_counter()
                sync(sender, quantizer.quantize(named)[0])
                e2e_s.append(time.perf_counter() - t0)
            nbytes = sum(b.numel() for b in bufs)
            results[fmt] = {"bytes": nbytes, "buckets": len(bufs), "quantize_s": quant_s,
                            "sync_s": min(sync_s), "sync_no_apply_s": min(bare_s),
                            "sync_copy_s": min(copy_s),
                            "sync_packed_s": min(packed_s), "raw_s": min(raw_s),
                            "e2e_s": min(e2e_s)}
        ctl.put(("stop",))
        group.close()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    print(f"weight sync bench: {n_params / 1e6:.1f}M params ({shapes} shapes), gloo loopback, "
          f"bucket {bucket_mb:g} MiB, best of {repeats}")
    cols = (("sync", "sync_s"), ("no-apply", "sync_no_apply_s"), ("copy", "sync_copy_s"),
            ("packed", "sync_packed_s"))
    print(f"{'format':<6} {'MiB/sync':>9} {'buckets':>7} {'sync MiB/s':>11} {'raw MiB/s':>10} "
          + " ".join(f"{c + '/raw':>12}" for c, _ in cols) + f" {'quantize s':>10} {'e2e s':>7}")
    for fmt, r in results.items():
        print(f"{fmt:<6} {_mb(r['bytes'])} {r['buckets']:7d} {_mb(r['bytes'] / r['sync_s']):>11} "
              f"{_mb(r['bytes'] / r['raw_s']):>10} "
              + " ".join(f"{r['raw_s'] / r[k]:12.2f}" for _, k in cols)
              + f" {r['quantize_s']:10.3f} {r['e2e_s']:7.3f}")
    print("sync: chunks laid out in wire buckets (qurl/weights/arena.py, as the pipeline makes them): "
          "announce + broadcast + the receiver validating every chunk and adopting it (double-"
          "banked receive buffers, as LocalEngine does) + ack; no-apply: the receiver drops the "
          "chunks (transport only); copy: the receiver copies every chunk into the engine's own "
          "tensors; packed: copy, and the chunks are separate tensors the WeightSender first copies into "
          "a send buffer (the path before arenas); raw: gloo broadcast of the same bucket sizes; "
          "quantize: fp32 -> chunks in fresh tensors; e2e: quantize into the arena + sync")
    print(f"bytes per sync int8 / bf16 = {results['int8']['bytes'] / results['bf16']['bytes']:.3f}")
    return results


if __name__ == "__main__":
    bench_sync()
