"""UAQ on a real model: flip fraction per sync at RL learning rates, and the function left unchanged.

    python -m qurl.research.studies.uaq_probe --batch DIR/gen_int8.pt --out uaq.jsonl \
        [--scales 1 1.5] [--lrs 1e-6 5e-6] [--steps 2] [--rows 4] [--no-invariance]

For each UAQ scale s the Megatron learner (fp32, TP 1) is built from the checkpoint with
`algo.uaq_scale = s` (qurl.quant.uaq: q/k/v and gate/up divided by s, their RMSNorm gains times s).

1. **Invariance.** The fp32 HF model's full-vocabulary logits on the batch's first rows with
   `apply_uaq(state, s)` against the unscaled model: max |Δlogit| and the logits' own scale. In
   exact arithmetic they are equal; in fp32 they differ by rounding only.
2. **Flip fraction.** From the same initial state, for each learning rate: `--steps` real
   `train_step`s (preset acr, 1 mini-batch, AdamW with the config's betas/eps, weight decay 0,
   grad clip 1.0) on `--rows` sampled responses of the batch with advantages +1/−1 alternating by
   row (the batch's own GRPO advantages are mostly 0 on this model: its rewards are rarely 1;
   under Adam the step size is ~lr whatever the gradient's scale, so the sign pattern is what
   matters), syncing after each step through `qurl.weights.publish.WeightSync` in INT8 and FP8: the share
   of 8-bit codes that changed since the previous sync, overall, in the layers UAQ scales
   (q/k/v/gate/up) and in the others (o/down).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch


def _learner(model: str, s: float, lr: float, seed: int):
    from qurl.learner.megatron import MegatronLearner
    from qurl.models.registry import resolve_base
    from qurl.research.studies.mismatch_collect import study_config

    cfg = study_config(model, "int8", "float32", seed)
    algo = replace(cfg.algo, uaq_scale=s, mini_batches=1, loss="acr")
    optim = replace(cfg.optim, lr=lr, weight_decay=0.0, warmup_steps=0, schedule="constant")
    return MegatronLearner(resolve_base(model), cfg.model, algo, optim, cfg.learner,
                           total_steps=100, seed=seed, ranks=cfg.deploy.ranks), cfg


def _sync(syncs, learner) -> dict[str, float]:
    named = list(learner.named_weights())
    out = {}
    for fmt, ws in syncs.items():
        _, st = ws.quantize(iter(named))
        out.update({f"{fmt}/{k}": v for k, v in st.items() if k.startswith("flip_frac")})
    return out


def probe(batch: dict, model: str, scales: list[float], lrs: list[float], steps: int, rows: int,
          seed: int, emit) -> None:
    """Flip fractions per sync (see the module docstring); each row is passed to `emit` as it is
    measured (a long run on a busy machine keeps what it measured if it is stopped)."""
    from qurl.weights.publish import WeightSync

    tokens, mask, behav, adv = _rows(batch, rows)
    for s in scales:
        learner, _ = _learner(model, s, lrs[0], seed)
        start = copy.deepcopy(learner.state_dict()) if len(lrs) > 1 else None
        for i, lr in enumerate(lrs):
            if i:
                learner.load_state_dict(start)  # the start state is not used again after the last
                start = copy.deepcopy(start) if i < len(lrs) - 1 else None
            learner.optim = replace(learner.optim, lr=lr)
            syncs = {fmt: WeightSync(fmt) for fmt in ("int8", "fp8")}
            _sync(syncs, learner)  # version 0: the codes every later sync is compared with
            for k in range(1, steps + 1):
                st = learner.train_step(tokens, mask, behav, adv, temperature=1.0)
                emit({"kind": "flip", "s": s, "lr": lr, "step": k, "rows": rows,
                      "tokens": int(mask.sum()), "grad_norm": st["grad_norm"],
                      "skipped": st["skipped_updates"], **_sync(syncs, learner)})
        del learner, start


def _rows(batch: dict, rows: int):
    """The first `rows` responses, cut after the last response column; advantages +1/−1 by row."""
    mask = batch["loss_mask"][:rows].float()
    ends = int(mask.nonzero()[:, 1].max()) + 1
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(rows)])
    return batch["tokens"][:rows, :ends], mask[:, :ends], batch["behav_logp"][:rows, :ends], adv


def invariance(batch: dict, model: str, scales: list[float], rows: int, emit) -> None:
    """max |Δlogit| of the fp32 HF model with UAQ at each s against s = 1, on `rows` responses."""
    from qurl.models.hf import load_checkpoint
    from qurl.models.registry import resolve_base
    from qurl.quant.uaq import apply_uaq

    tokens, _, _, _ = _rows(batch, rows)
    hf, _ = load_checkpoint(resolve_base(model), dtype=torch.float32)
    hf.requires_grad_(False)
    base = {k: v.clone() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        ref = hf(input_ids=tokens, use_cache=False).logits.float()
        for s in scales:
            hf.load_state_dict(apply_uaq(base, s), strict=False)
            d = (hf(input_ids=tokens, use_cache=False).logits.float() - ref).abs()
            emit({"kind": "invariance", "s": s, "max_abs_dlogit": float(d.max()),
                  "mean_abs_dlogit": float(d.mean()), "max_abs_logit": float(ref.abs().max()),
                  "positions": int(tokens.numel())})


def main(argv: list[str] | None = None) -> int:
    from qurl.learner.dist import destroy_learner_dist, init_learner_dist
    from qurl.research.studies.mismatch_collect import study_config

    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.uaq_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", required=True, type=Path, help="a gen_<precision>.pt of mismatch_collect")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--scales", type=float, nargs="+", default=[1.0, 1.5])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 5e-6])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-invariance", action="store_true")
    a = p.parse_args(argv)
    if not a.batch.is_file():
        print(f"{a.batch}: no such file (run qurl.research.studies.mismatch_collect gen first)", file=sys.stderr)
        return 2
    from qurl.learner.dist import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    a.out.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.load(a.batch)

    def emit(row: dict) -> None:
        line = json.dumps({**row, "model": a.model})
        print(line, flush=True)
        with a.out.open("a") as f:
            f.write(line + "\n")

    if not a.no_invariance:
        invariance(batch, a.model, [s for s in a.scales if s != 1.0], a.rows, emit)
    if a.steps:
        cfg = study_config(a.model, "int8", "float32", a.seed)
        init_learner_dist(cfg.learner, 0, 1, ranks=cfg.deploy.ranks, host=cfg.deploy.host)
        try:
            probe(batch, a.model, a.scales, a.lrs, a.steps, a.rows, a.seed, emit)
        finally:
            destroy_learner_dist()
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
