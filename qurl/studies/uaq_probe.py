"""UAQ on a real model: flip fraction per sync at RL learning rates, and the function left unchanged.

    python -m qurl.studies.uaq_probe --batch DIR/gen_int8.pt --out uaq.json \
        [--scales 1 1.5] [--lrs 1e-6 5e-6] [--steps 2] [--rows 4]

For each UAQ scale s the Megatron learner (fp32, TP 1) is built from the checkpoint with
`algo.uaq_scale = s` (qurl.quant.uaq: q/k/v and gate/up divided by s, their RMSNorm gains times s).

1. **Invariance.** The learner's full-vocabulary logits on the batch's first rows, at s and at
   s = 1 (the first scale listed must be 1): max |Δlogit| and the logits' own scale. In exact
   arithmetic they are equal; in fp32 they differ by rounding only.
2. **Flip fraction.** From the same initial state, for each learning rate: `--steps` real
   `train_step`s (preset acr, 1 mini-batch, AdamW with the config's betas/eps, weight decay 0,
   grad clip 1.0) on `--rows` sampled responses of the batch with advantages +1/−1 alternating by
   row (the batch's own GRPO advantages are mostly 0 on this model: its rewards are rarely 1;
   under Adam the step size is ~lr whatever the gradient's scale, so the sign pattern is what
   matters), syncing after each step through `qurl.weights.WeightSync` in INT8 and FP8: the share
   of 8-bit codes that changed since the previous sync, overall, in the layers UAQ scales
   (q/k/v/gate/up) and in the others (o/down).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch


def _learner(model: str, s: float, lr: float, seed: int):
    from qurl.learner.megatron import MegatronLearner
    from qurl.models.registry import resolve_base
    from qurl.studies.mismatch_collect import study_config

    cfg = study_config(model, "int8", "float32", seed)
    algo = replace(cfg.algo, uaq_scale=s, mini_batches=1, loss="acr")
    optim = replace(cfg.optim, lr=lr, weight_decay=0.0, warmup_steps=0, schedule="constant")
    return MegatronLearner(resolve_base(model), cfg.model, algo, optim, cfg.learner,
                           total_steps=100, seed=seed, deploy=cfg.deploy), cfg


def _sync(syncs, learner) -> dict[str, float]:
    named = list(learner.named_weights())
    out = {}
    for fmt, ws in syncs.items():
        _, st = ws.quantize(iter(named))
        out.update({f"{fmt}/{k}": v for k, v in st.items() if k.startswith("flip_frac")})
    return out


def probe(batch: dict, model: str, scales: list[float], lrs: list[float], steps: int, rows: int,
          seed: int) -> dict:
    from qurl.weights import WeightSync

    if scales[0] != 1.0:
        raise ValueError("the first scale must be 1 (the reference of the invariance check)")
    tokens, mask = batch["tokens"][:rows], batch["loss_mask"][:rows].float()
    behav = batch["behav_logp"][:rows]
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(rows)])
    ends = int(mask.nonzero()[:, 1].max()) + 1
    tokens, mask, behav = tokens[:, :ends], mask[:, :ends], behav[:, :ends]
    out: dict = {"rows": rows, "tokens": int(mask.sum()), "steps": steps, "flips": [],
                 "invariance": []}
    ref_logits = None
    for s in scales:
        t0 = time.perf_counter()
        learner, _ = _learner(model, s, lrs[0], seed)
        logits = learner.logits(tokens[:2]).cpu()
        if ref_logits is None:
            ref_logits = logits
        else:
            d = (logits - ref_logits).abs()
            out["invariance"].append({"s": s, "max_abs_dlogit": float(d.max()),
                                      "mean_abs_dlogit": float(d.mean()),
                                      "max_abs_logit": float(ref_logits.abs().max()),
                                      "positions": int(logits.shape[0] * logits.shape[1])})
        start = copy.deepcopy(learner.state_dict())
        for lr in lrs:
            learner.load_state_dict(copy.deepcopy(start))
            learner.optim = replace(learner.optim, lr=lr)
            syncs = {fmt: WeightSync(fmt) for fmt in ("int8", "fp8")}
            _sync(syncs, learner)  # version 0: the codes every later sync is compared with
            for k in range(1, steps + 1):
                st = learner.train_step(tokens, mask, behav, adv, temperature=1.0)
                row = {"s": s, "lr": lr, "step": k, "grad_norm": st["grad_norm"],
                       "skipped": st["skipped_updates"], **_sync(syncs, learner)}
                out["flips"].append(row)
                print(json.dumps(row), flush=True)
        out.setdefault("seconds", {})[str(s)] = time.perf_counter() - t0
        del learner
    return out


def main(argv: list[str] | None = None) -> int:
    from qurl.learner.dist import destroy_learner_dist, init_learner_dist
    from qurl.studies.mismatch_collect import study_config

    p = argparse.ArgumentParser(prog="python -m qurl.studies.uaq_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", required=True, type=Path, help="a gen_<precision>.pt of mismatch_collect")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--scales", type=float, nargs="+", default=[1.0, 1.5])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 5e-6])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not a.batch.is_file():
        print(f"{a.batch}: no such file (run qurl.studies.mismatch_collect gen first)", file=sys.stderr)
        return 2
    from qurl.learner.dist import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    cfg = study_config(a.model, "int8", "float32", a.seed)
    init_learner_dist(cfg.learner, 0, 1, deploy=cfg.deploy)
    try:
        res = probe(torch.load(a.batch), a.model, a.scales, a.lrs, a.steps, a.rows, a.seed)
    finally:
        destroy_learner_dist()
    res.update(model=a.model, batch=str(a.batch))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
