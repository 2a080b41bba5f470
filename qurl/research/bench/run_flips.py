"""What a real training run changes between two syncs, per kind of engine chunk.

`qurl bench sync` prices delta sync at large shapes (qurl/research/bench/sync.py); the share of each kind
of chunk that changes per step is the input it needs, and only a real run gives it. This module
runs the synchronous loop (`qurl.commands.train.train`, deploy.rollout = inline) with every sync observed: for each version after
the first it compares the engine chunks with the previous version's, bit for bit, and records

    codes    share of 8-bit codes whose bits changed (the flip fraction)
    scales   share of fp32 per-channel scales that changed
    pass     share of pass-through values (embeddings, norms, biases) that changed, as the local
             engine gets them (fp32)
    pass_bf16 the same, cast to bf16 (what an SGLang engine holds, and is sent)

with the run's train records (reward, `kl_behav_prox`: the mismatch KL between the 8-bit engine
and the full-precision policy, `sync/bytes`, `sync/full_bytes`).

    python -m qurl.research.bench.run_flips --set rollout.uaq_scale=1.5 --set run.steps=6 ...
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from qurl.quant.named import is_quantized_linear


def chunk_kind(name: str, t: torch.Tensor) -> str:
    if t.dtype in (torch.int8, torch.float8_e4m3fn):
        return "codes"
    if name.endswith(("_scale", "_scale_inv")) and is_quantized_linear(name.rsplit("_scale", 1)[0]):
        return "scales"
    return "pass"


def change_fractions(prev: dict[str, torch.Tensor], new: list[tuple[str, torch.Tensor]]
                     ) -> dict[str, float]:
    """Per kind: changed elements / elements (bitwise); pass_bf16 compares the bf16 casts."""
    from qurl.weights.delta import changed_positions

    changed: dict[str, int] = {}
    total: dict[str, int] = {}
    for name, t in new:
        kinds = [chunk_kind(name, t)]
        pairs = [(prev[name], t)]
        if kinds[0] == "pass" and t.is_floating_point():
            kinds.append("pass_bf16")
            pairs.append((prev[name].to(torch.bfloat16), t.to(torch.bfloat16)))
        for k, (a, b) in zip(kinds, pairs):
            changed[k] = changed.get(k, 0) + int(changed_positions(a, b).numel())
            total[k] = total.get(k, 0) + t.numel()
    return {k: changed[k] / total[k] for k in total}


def measure(sets: list[str]) -> list[dict[str, Any]]:
    """Run the sync loop with `--set` overrides; one dict per sync after the first: the change
    fractions, joined with that step's train record."""
    from qurl.config import load_config
    from qurl.commands.train import train
    from qurl.train.metrics_log import read_metrics
    from qurl.weights.publish import WeightSync

    cfg = load_config(sets=sets)
    seen: list[dict[str, float]] = []
    prev: dict[str, torch.Tensor] = {}
    orig = WeightSync.quantize

    def quantize(self, named):  # type: ignore[no-untyped-def]
        chunks, stats = orig(self, named)
        if self.precision != cfg.rollout.precision:  # the evaluator's full-precision policy
            return chunks, stats
        if prev:
            seen.append(change_fractions(prev, chunks))
        prev.clear()
        prev.update({n: t.clone() for n, t in chunks})
        return chunks, stats

    WeightSync.quantize = quantize  # type: ignore[method-assign]
    try:
        train(cfg)
    finally:
        WeightSync.quantize = orig  # type: ignore[method-assign]
    from pathlib import Path

    recs = [r for r in read_metrics(Path(cfg.deploy.dir) / cfg.run.name / "metrics.jsonl")
            if r.get("kind") == "train"]
    keys = ("step", "reward", "kl_behav_prox", "flip_frac", "sync/bytes", "sync/full_bytes",
            "sync/verified")
    return [{**frac, **{k: r.get(k) for k in keys}} for frac, r in zip(seen, recs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qurl.research.bench.run_flips", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    p.add_argument("--out", default="", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    rows = measure(args.sets)
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
