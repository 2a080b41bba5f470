"""How finely an 8-bit greedy evaluation resolves a policy: the run's own weights, moved by one
unit in the last place (ulp), evaluated as the run evaluates them.

Why it is asked. `qurl export` gives a policy back in the base model's parameterisation: UAQ's
q/k/v/gate/up ÷ s and norm × s (qurl/quant/uaq.py) undone in fp32. Evaluating that export, or
training from it, applies UAQ again, and fl(fl(x · s) / s) is not always x when s is not a power
of two (s = 1.5 needs one more mantissa bit than fp32 has for about half of all values): some
weights come back one ulp away. Nothing else changes. Whether that matters is a property of the
evaluation, not of the export: an 8-bit engine quantizes every activation per token, so a
one-ulp change upstream can move one activation across a rounding boundary (a whole int8 step),
and a greedy decode that meets a near-tie a few tokens later answers differently.

What it measures. The run's checkpoint is loaded into the learner once; each arm hands the
engine a variant of its fp32 masters through the weight sync, exactly as `qurl eval` does, and
scores the run's held-out sets greedily:

    run          the masters as they are: `qurl eval RUN`'s numbers
    round trip   UAQ undone and re-applied in memory (what an export read back gets)
    ulp k        every norm gain nudged one ulp up or down at random (seed k), no linear touched

and prints, per arm, the greedy accuracy and how many answers differ from the run's, word for
word. If the round trip moves the answers no more than a one-ulp nudge of the run's own weights
does, the export is as exact as the evaluation can tell.

    python -m qurl.research.studies.ulp_sensitivity runs/<run> [--nudges 2] [--out ulp.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def nudged(masters: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """`masters` with every RMSNorm gain ([hidden] or [head_dim], fp32) moved one ulp toward +inf
    or -inf, each element by a fair coin of generator `seed`; linears and embeddings untouched."""
    g = torch.Generator().manual_seed(seed)
    out = dict(masters)
    for name, t in masters.items():
        if name.endswith("norm.weight"):
            up = torch.rand(t.shape, generator=g) < 0.5
            out[name] = torch.where(up, torch.nextafter(t, torch.full_like(t, torch.inf)),
                                    torch.nextafter(t, torch.full_like(t, -torch.inf)))
    return out


def _entry(cfg, *, run_dir: str, nudges: int, rank: int, world_size: int) -> dict:
    from qurl.checkpoint.rundir import CheckpointDir
    from qurl.engines.factory import ServerSite, engine_wire_dtype, make_engine
    from qurl.train.eval_suite import Evaluator
    from qurl.learner.dist import init_learner_dist
    from qurl.learner.megatron import MegatronLearner
    from qurl.models.registry import resolve_base
    from qurl.quant.uaq import apply_uaq
    from qurl.weights.publish import WeightSync
    from qurl.weights.settings import SyncSettings

    init_learner_dist(cfg.learner, rank, world_size, ranks=cfg.deploy.ranks, host=cfg.deploy.host)
    model_dir = resolve_base(cfg.model.base)
    learner = MegatronLearner(model_dir, cfg.model, cfg.algo, cfg.optim, cfg.learner,
                              total_steps=cfg.run.steps, seed=cfg.run.seed, ranks=cfg.deploy.ranks)
    ckpt = CheckpointDir(Path(run_dir)).latest()
    learner.load(ckpt)
    masters = {n: t.detach().to("cpu", torch.float32).clone() for n, t in learner.named_weights()}
    s = cfg.algo.uaq_scale
    arms = {"run": masters, "round trip": apply_uaq(apply_uaq(masters, 1.0 / s), s)}
    arms.update({f"ulp {k}": nudged(masters, k) for k in range(nudges)})
    step = int(ckpt.name.removeprefix("step_"))
    out = {}
    for name, weights in arms.items():
        engine = make_engine(cfg.rollout, cfg.sglang, SyncSettings.of(cfg.deploy.sync), model_dir,
                             seed=cfg.run.seed,
                             site=ServerSite.of(cfg.deploy, cfg.run, cfg.algo, cfg.learner))
        try:
            WeightSync(cfg.rollout.precision,
                       wire_dtype=engine_wire_dtype(cfg.rollout, cfg.sglang, model_dir)
                       ).push(iter(weights.items()), engine, version=0)
            ev = Evaluator(cfg.eval, cfg.data, cfg.rollout, cfg.deploy, model_dir,
                           seed=cfg.run.seed, main=True, max_examples=None, per_question=False,
                           answers=True)
            rec = ev.run(step, step, engine, learner)
        finally:
            engine.close()
        changed = sum(int(not torch.equal(weights[n], masters[n])) for n in masters)
        out[name] = {"accuracy": rec["accuracy"], "answers": rec["eval_answers"],
                     "tensors_changed": changed}
        print(f"{name}: accuracy {rec['accuracy']:.4f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from qurl.checkpoint.rundir import read_config
    from qurl.config import override
    from qurl.commands.ranks import run_ranks

    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.ulp_sensitivity",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--nudges", type=int, default=2, help="one-ulp nudge arms (seeds 0..n-1)")
    p.add_argument("--out", default=None, help="also write every arm's answers here (JSON)")
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    cfg = override(read_config(run), {"deploy.dir": str(run.parent), "run.name": run.name,
                                      "eval.fp_policy": False})
    if cfg.rollout.precision == "bf16":
        raise SystemExit(f"{run}: a bf16 run; this study is about the 8-bit actor")
    res = run_ranks(_entry, cfg.learner, cfg, run_dir=str(run), nudges=args.nudges)
    ref = [a for v in res["run"]["answers"].values() for a in v]
    print(f"\n{run} ({cfg.model.base}, {cfg.rollout.precision}, UAQ s={cfg.algo.uaq_scale}), "
          f"{len(ref)} greedy held-out answers")
    print("| arm | tensors changed | greedy accuracy | answers differing from the run's |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in res.items():
        got = [a for v in r["answers"].values() for a in v]
        diff = sum(x != y for x, y in zip(ref, got))
        print(f"| {name} | {r['tensors_changed']} | {100 * r['accuracy']:.1f}% | {diff} |")
    if args.out:
        Path(args.out).write_text(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
