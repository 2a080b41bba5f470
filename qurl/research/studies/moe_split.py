"""Is a MoE derived from a dense model a language model, and how stable is its routing in 8 bits?

    python -m qurl.research.studies.moe_split NAME=DIR [NAME=DIR ...] [--tokens 600]
        [--set math500] [--rows 0 20] [--precisions bf16 int8 fp8] [--threads 2]

Each checkpoint (a dense Llama, or a Mixtral made by qurl/models/moe_from_dense.py) is loaded by
the local engine (qurl/engines/local.py) at every precision, and scored teacher-forced on held-out
text: rows of a set the calibration never reads (`math500`'s problems in the chat template with
their worked solutions, qurl/models/moe_calibrate.py `set_texts`; the first `--tokens` tokens).
Per checkpoint and precision, one JSON line:
- `loss`: mean next-token cross-entropy, nats/token (uniform over SmolLM2's 49,152: 10.8);
- `flip_vs_bf16` (a MoE at int8/fp8): share of (token, layer) whose top-k expert set differs from
  the one the same engine picks at bf16 on the same tokens: the routes come from the engine's own
  RouteSink (`GenResult.routed_experts`'s source), so these are the "engine-only flips" of
  docs/moe.md, with no learner and no sampling in between.
The local engine at "bf16" computes in fp32 (no quantization): it is the reference.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from qurl.engines.local import LocalEngine
from qurl.models.hf import load_tokenizer
from qurl.models.moe_calibrate import set_texts, take_tokens


def score(model_dir: str, precision: str, seqs: list[list[int]]
          ) -> tuple[float, torch.Tensor | None]:
    """Mean loss per token (nats) of `seqs` under the local engine at `precision`, and a MoE's
    routes [sum(len(s)), L, k] uint8 (None for a dense model)."""
    eng = LocalEngine(model_dir, precision=precision)
    sink = eng._routes
    nll, n, routes = 0.0, 0, []
    for s in seqs:
        if sink is not None:
            sink.start()
        logits = eng.token_logits(s[:1], s[1:])  # [len(s) - 1, V]
        if sink is not None:
            routes.append(sink.take(1, len(s))[0])
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(s[1:]), reduction="sum")
        if not torch.isfinite(loss):
            raise ValueError(f"{model_dir} at {precision}: non-finite loss")
        nll += float(loss)
        n += len(s) - 1
    return nll / n, torch.cat(routes) if routes else None


def flip_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of (token, layer) whose expert sets differ: a, b [N, L, k] expert ids."""
    if a.shape != b.shape:
        raise ValueError(f"routes {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a.sort(-1).values != b.sort(-1).values).any(-1).float().mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.moe_split")
    p.add_argument("models", nargs="+", help="NAME=DIR")
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--set", default="math500")
    p.add_argument("--rows", type=int, nargs=2, default=[0, 20])
    p.add_argument("--precisions", nargs="+", default=["bf16", "int8", "fp8"])
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    models = [m.split("=", 1) for m in a.models]
    if any(len(m) != 2 for m in models) or a.precisions[0] != "bf16":
        raise SystemExit("models are NAME=DIR, and --precisions starts with bf16 (the reference)")
    tok = load_tokenizer(models[0][1])
    seqs = take_tokens(set_texts(tok, a.set, range(*a.rows)), a.tokens)
    for name, path in models:
        ref = None
        for prec in a.precisions:
            loss, routes = score(path, prec, seqs)
            row = {"model": name, "precision": prec, "tokens": sum(map(len, seqs)),
                   "loss": round(loss, 4)}
            if routes is not None and ref is not None:
                row["flip_vs_bf16"] = round(flip_fraction(routes, ref), 4)
            ref = routes if prec == "bf16" else ref
            print(json.dumps(row), flush=True)
            if routes is None:
                break  # a dense model: its loss at bf16 only
    return 0


if __name__ == "__main__":
    sys.exit(main())
