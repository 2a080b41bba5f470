"""Routing replay on a mixture of experts, measured: rollout precision x replay over seeds.

An 8-bit engine and the full-precision learner can send the same token to different experts
(the engine's rounding moves a router logit past its neighbour's). The learner's π_prox then
scores a token with other experts than the ones that sampled it, and KL(π_behav‖π_prox) carries
that routing gap on top of the 8-bit one. Routing replay (`algo.routing_replay=rollout`) makes the
learner use the engine's experts in every forward, so the gap left is the experts' own arithmetic.
This study runs each (precision, replay) arm for a few steps per seed with `qurl train` and tables,
per arm over seeds:

    route flip        moe/route_flip_frac: share of (completion token, layer) whose learner top-k
                      set differs from the engine's (with replay on the learner still computes its
                      own choice, given the replayed earlier layers, so the number stays measured)
    any flip          moe/tokens_any_flip: share of tokens with a flip in at least one layer
    KL(behav‖prox)    kl_behav_prox, the k3 estimate, mean over the run's steps
    clipped           clip_frac_low + clip_frac_high, mean over steps
    reward            the training reward: first step, mean over steps, last step
    held-out          greedy accuracy of the 8-bit engine at the first evaluation (step 0) and
                      the final one, and the fp policy's at the final one

Arms are named `<precision>-replay-<off|rollout>`; every other setting is the caller's config
(the default is smollm2-arith's task at a small batch on `smollm2-135m-moe`). Records go to
`<out>/<arm>/seed<S>/metrics.jsonl` as each arm finishes (its checkpoints are then deleted);
run directories to `--runs`; an arm recorded in `<out>` is not run again, and an interrupted run
is resumed from its last checkpoint (qurl/research/studies/runner.py). `--table-only` rebuilds
`<out>/table.md` from the records.

    python -m qurl.research.studies.moe_replay --seeds 0,1,2 --out docs/data/moe_replay \\
        --runs runs/moe_replay [--precisions bf16,int8,fp8] [--set key=value ...] [--table-only]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path
from typing import Any

from qurl.config import Config, override
from qurl.config.presets import PRESETS
from qurl.train.metrics_log import read_metrics

REPLAY = ("off", "rollout")
# smollm2-arith's task on the derived MoE, small enough for a few CPU minutes a run
DEFAULTS: dict[str, Any] = {
    "model.base": "smollm2-135m-moe", "run.steps": 4, "run.eval_every": 4,
    "rollout.prompts_per_step": 4, "rollout.group_size": 4, "data.eval_size": 10,
    "algo.mini_batches": 1, "deploy.torch_threads": 1, "deploy.progress": False,
    "deploy.ckpt_every": 2, "deploy.rollout": "inline",
}


def arm_name(precision: str, replay: str) -> str:
    return f"{precision}-replay-{replay}"


def arm_config(base: Config, precision: str, replay: str, seed: int, runs: Path) -> Config:
    """The run of one arm and seed: base with the arm's precision and replay, under runs/seed<S>/."""
    return override(base, {"rollout.precision": precision, "algo.routing_replay": replay,
                           "run.seed": seed, "deploy.dir": str(runs / f"seed{seed}"),
                           "run.name": arm_name(precision, replay)})


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def run_summary(records: list[dict]) -> dict[str, Any]:
    """One run's row (module docstring): means over its train records, first/mean/last reward,
    its first evaluation's greedy accuracy of the engine and its last one's of the engine and of
    the fp policy (None where absent)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise ValueError("no train records")

    def mean_of(key: str) -> float | None:
        return _mean([r[key] for r in train if key in r])

    clipped = [r.get("clip_frac_low", 0.0) + r.get("clip_frac_high", 0.0) for r in train]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    return {"steps": len(train), "flip": mean_of("moe/route_flip_frac"),
            "any_flip": mean_of("moe/tokens_any_flip"), "kl": mean_of("kl_behav_prox"),
            "clipped": _mean(clipped), "reward_first": train[0].get("reward"),
            "reward_mean": mean_of("reward"), "reward_last": train[-1].get("reward"),
            "acc_first": first.get("eval/mean/greedy"), "acc": last.get("eval/mean/greedy"),
            "acc_fp": last.get("eval_fp/mean/greedy")}


def _cell(xs: list[float | None], fmt: str) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(statistics.fmean(xs), fmt)} ± {format(statistics.stdev(xs), fmt)}"


def table(out: Path) -> str:
    """The markdown table over every arm and seed recorded under `out` (mean ± sd over seeds)."""
    rows = []
    for arm_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        runs = {int(d.name[4:]): run_summary(read_metrics(d / "metrics.jsonl"))
                for d in sorted(arm_dir.glob("seed*")) if (d / "metrics.jsonl").exists()}
        if not runs:
            continue
        col = {k: [r[k] for r in runs.values()] for k in next(iter(runs.values()))}
        rows.append(f"| {arm_dir.name} | {', '.join(map(str, sorted(runs)))} | "
                    f"{_cell(col['steps'], '.0f')} | {_cell(col['flip'], '.3f')} | "
                    f"{_cell(col['any_flip'], '.3f')} | {_cell(col['kl'], '.2e')} | "
                    f"{_cell(col['clipped'], '.3f')} | {_cell(col['reward_first'], '.3f')} | "
                    f"{_cell(col['reward_mean'], '.3f')} | {_cell(col['reward_last'], '.3f')} | "
                    f"{_cell(col['acc_first'], '.3f')} | {_cell(col['acc'], '.3f')} | "
                    f"{_cell(col['acc_fp'], '.3f')} |")
    head = ("| arm | seeds | steps | route flip | any flip | KL(behav‖prox) | clipped | "
            "reward step 1 | reward, mean | reward last | held-out greedy step 0, engine | "
            "held-out greedy, engine | held-out greedy, fp policy |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(rows) + "\n"


def study(base: Config, out: Path, runs: Path, seeds: list[int], precisions: list[str]) -> Path:
    """Run every (precision, replay, seed) not yet recorded in `out`, then write out/table.md."""
    from qurl.research.studies.runner import run_to_end

    for seed in seeds:
        for precision in precisions:
            for replay in REPLAY:
                cfg = arm_config(base, precision, replay, seed, runs)
                dest = out / cfg.run.name / f"seed{seed}"
                if (dest / "metrics.jsonl").exists():
                    continue
                how = run_to_end(cfg)
                run_dir = Path(cfg.deploy.dir) / cfg.run.name
                dest.mkdir(parents=True, exist_ok=True)
                for name in ("metrics.jsonl", "config.toml"):
                    shutil.copy2(run_dir / name, dest / name)
                # a finished arm's checkpoints are ~4 GB on smollm2-135m-moe (weights and Adam
                # moments, two kept): twelve arms filled a 250 GB disk's last 47 GB
                shutil.rmtree(run_dir / "ckpt", ignore_errors=True)
                print(f"seed {seed} {cfg.run.name}: {how}", flush=True)
    path = out / "table.md"
    path.write_text(table(out))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.moe_replay",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--runs", type=Path, default=Path("runs/moe_replay"))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--precisions", default="bf16,int8,fp8")
    p.add_argument("--preset", default="smollm2-arith")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--table-only", action="store_true")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.table_only:
        path = a.out / "table.md"
        path.write_text(table(a.out))
    else:
        sets = dict(DEFAULTS, **dict(s.split("=", 1) for s in a.set))
        base = override(PRESETS[a.preset](), sets)
        path = study(base, a.out, a.runs.resolve(), [int(s) for s in a.seeds.split(",")],
                     a.precisions.split(","))
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
