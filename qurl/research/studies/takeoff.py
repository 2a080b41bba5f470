"""Did a run take off? The same recipe over seeds, one row per run, and one figure.

RL on a small model from a weak start often does nothing for many steps, then "takes off": the
training reward (the share of right answers among the step's samples at T = 1) rises within a
few steps from near its start to most answers right. Whether and when that happens differs from
seed to seed, so one run says little about a recipe: this module puts runs of one recipe side by
side.

Per run (a run directory, or any directory holding its `metrics.jsonl` and `config.toml`):
- take-off step: the first train step whose reward exceeds `THRESHOLD` (0.5), "none" if no step
  does;
- reward: first step, and the mean over the last `LAST` steps;
- entropy of π_prox at the sampled tokens (the learner's `entropy`): first step, step 5, and the
  mean over the last `LAST` steps. A policy whose entropy falls toward 0 before its reward rises
  samples nearly the same answer for every member of a group, so groups carry no signal
  (all-equal rewards give zero GRPO advantages) and learning stops;
- KL(behav‖prox): mean over the run (the 8-bit rollout's mismatch);
- held-out greedy accuracy at the first and the last evaluation, of the rollout engine and, where
  evaluated, of the full-precision policy.

    python -m qurl.research.studies.takeoff RUN [RUN ...] [--plot out.png]

prints the markdown table (and draws reward and entropy against step, one line per run).
"""
from __future__ import annotations

import argparse
import math
import tomllib
from pathlib import Path
from typing import Any

from qurl.train.metrics_log import read_metrics

THRESHOLD = 0.5
LAST = 5


def _train(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "train"]


def takeoff_step(records: list[dict[str, Any]], threshold: float = THRESHOLD) -> int | None:
    """The first train step whose reward is above `threshold`, None if none is."""
    for r in _train(records):
        if isinstance(r.get("reward"), (int, float)) and r["reward"] > threshold:
            return int(r["step"])
    return None


def _mean(values: list[float]) -> float:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def run_row(run: Path) -> dict[str, Any]:
    """One run's row (module docstring); `seed` from its config.toml when there is one."""
    records = read_metrics(Path(run) / "metrics.jsonl")
    train = _train(records)
    if not train:
        raise ValueError(f"{run}: no train records in metrics.jsonl")
    evals = [r for r in records if r.get("kind") == "eval"]
    cfg_path = Path(run) / "config.toml"
    seed = tomllib.loads(cfg_path.read_text())["run"]["seed"] if cfg_path.is_file() else None
    at = {int(r["step"]): r for r in train}
    tail = train[-LAST:]
    row = {"run": Path(run).name, "seed": seed, "steps": int(train[-1]["step"]),
           "takeoff": takeoff_step(records),
           "reward_first": train[0].get("reward"), "reward_last": _mean([r.get("reward") for r in tail]),
           "entropy_first": train[0].get("entropy"),
           "entropy_5": at[5].get("entropy") if 5 in at else None,
           "entropy_last": _mean([r.get("entropy") for r in tail]),
           "kl": _mean([r.get("kl_behav_prox") for r in train])}
    for name, rec in (("first", evals[0] if evals else {}), ("last", evals[-1] if evals else {})):
        row[f"eval_{name}_step"] = rec.get("step")
        row[f"greedy_{name}"] = rec.get("eval/mean/greedy")
        row[f"greedy_fp_{name}"] = rec.get("eval_fp/mean/greedy")
    return row


def _pct(v: Any) -> str:
    return "–" if not isinstance(v, (int, float)) else f"{100 * v:.1f}%"


def _num(v: Any, digits: int = 2) -> str:
    return "–" if not isinstance(v, (int, float)) or not math.isfinite(v) else f"{v:.{digits}f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| run | seed | steps | take-off step | reward first / last 5 | entropy step 1 / 5 / last 5 "
            "| KL(behav‖prox) | greedy first → last (fp policy) |\n" + "|---" * 8 + "|\n")
    lines = []
    for r in rows:
        greedy = (f"{_pct(r['greedy_first'])} → {_pct(r['greedy_last'])} "
                  f"({_pct(r['greedy_fp_first'])} → {_pct(r['greedy_fp_last'])}), "
                  f"steps {r['eval_first_step']}→{r['eval_last_step']}")
        lines.append(f"| {r['run']} | {r['seed']} | {r['steps']} | "
                     f"{r['takeoff'] if r['takeoff'] is not None else 'none'} | "
                     f"{_num(r['reward_first'])} / {_num(r['reward_last'])} | "
                     f"{_num(r['entropy_first'])} / {_num(r['entropy_5'])} / {_num(r['entropy_last'])} | "
                     f"{_num(r['kl'], 4)} | {greedy} |")
    took = sum(r["takeoff"] is not None for r in rows)
    return head + "\n".join(lines) + f"\n\nTook off (reward > {THRESHOLD}): {took} of {len(rows)} runs.\n"


def plot(runs: list[Path], out: Path) -> Path:
    """Reward and entropy against step, one line per run, into a PNG at `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for run in runs:
        train = _train(read_metrics(Path(run) / "metrics.jsonl"))
        steps = [r["step"] for r in train]
        for ax, key in zip(axes, ("reward", "entropy")):
            ax.plot(steps, [r.get(key, float("nan")) for r in train], label=Path(run).name)
    axes[0].axhline(THRESHOLD, color="grey", lw=0.8, ls="--")
    for ax, title in zip(axes, ("training reward (T = 1)", "entropy of π_prox at the sampled tokens")):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qurl.research.studies.takeoff", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    print(markdown([run_row(r) for r in args.runs]), end="")
    if args.plot is not None:
        print(f"figure: {plot(args.runs, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
