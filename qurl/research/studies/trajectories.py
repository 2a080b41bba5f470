"""Each run's course, not only its end: the numbers a reader of an ablation checks first.

The ablation table (qurl/research/studies/tables.py) says where each arm ended and how far it sits from
bf16. Whether that end means anything needs the path to it: an arm that ends 6 points below bf16
may have learned less, or fallen and come back, or simply started 6 points lower (the engine's
format already costs accuracy at step 0, before any training). One line per (seed, arm):

- **accuracy at each evaluation**: the training evaluations' headline accuracy in points (Avg@k
  where every evaluation measured it, else greedy: `tables.acc_key`), step 0 first. The step-0
  value is the arm's own engine scoring the shared starting weights, so two arms of a seed differ
  there by the rollout format alone.
- **greedy at the end**: the last training evaluation's greedy accuracy, in points.
- **reward by block**: mean training reward over steps 1–B, B+1–2B, ... (B = tables.WINDOW); a
  last, shorter block is averaged over the steps it has.
- **KL(b‖p)**: mean `kl_behav_prox` over the train records that measured it (a bf16 arm's is ~0).
- **flips scaled / other**: mean `flip_frac/uaq_scaled` and `flip_frac/unscaled`, the share of
  8-bit codes that changed at a sync in the layers UAQ scales and in the rest (UAQ's larger
  effective steps show as a higher ratio); "—" where the run did not record them. A bf16 arm
  sends bf16 values, nearly all of which change every step (~1: nothing of quantization).

`python -m qurl.research.studies.trajectories PATH...` prints the same table for metrics.jsonl files or run
directories, finished or not: how a study's running arms are read before they are committed.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from qurl.research.studies.compare import _fmt, _md_table, _mean
from qurl.research.studies.tables import WINDOW, acc_key
from qurl.train.metrics_log import read_metrics

COLUMNS = ["seed", "arm", "steps", "accuracy at steps", "greedy end", "reward by block",
           "KL(b‖p)", "flips scaled / other"]


def _points(v: Any) -> str:
    return "—" if not isinstance(v, (int, float)) or not math.isfinite(v) else f"{100 * v:.1f}"


def blocks(values: list[float], size: int = WINDOW) -> list[float]:
    """Means of consecutive blocks of `size` values (the last may be shorter); NaN-free values
    only, NaN for a block with none."""
    return [_mean(values[i:i + size]) for i in range(0, len(values), size)]


def trajectory(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's course from its metrics records (kind "train" and "eval")."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not evals:
        raise ValueError("metrics have no eval record")
    key, name = acc_key(evals)
    return {
        "steps": len(train), "acc_name": name,
        "acc": [(int(r["step"]), r.get(key)) for r in evals],
        "greedy_end": evals[-1].get("eval/mean/greedy", evals[-1].get("accuracy")),
        "reward_blocks": blocks([r.get("reward") for r in train]),
        "kl": _mean([r.get("kl_behav_prox") for r in train]),
        "flip_scaled": _mean([r.get("flip_frac/uaq_scaled") for r in train]),
        "flip_other": _mean([r.get("flip_frac/unscaled") for r in train]),
    }


def _row(seed: Any, arm: str, t: dict[str, Any]) -> dict[str, Any]:
    steps = " / ".join(str(s) for s, _ in t["acc"])
    flips = ("—" if not math.isfinite(t["flip_scaled"])
             else f"{_fmt(t['flip_scaled'])} / {_fmt(t['flip_other'])}")
    return {"seed": seed, "arm": arm, "steps": t["steps"],
            "accuracy at steps": f"{' / '.join(_points(v) for _, v in t['acc'])} "
                                 f"({t['acc_name']} at {steps})",
            "greedy end": _points(t["greedy_end"]),
            "reward by block": " / ".join(_fmt(round(v, 2)) for v in t["reward_blocks"]),
            "KL(b‖p)": _fmt(t["kl"]), "flips scaled / other": flips}


def trajectories_markdown(records: dict[Any, dict[str, list[dict]]]) -> str:
    """{seed: {arm: records}} -> a markdown section, one row per (seed, arm)."""
    rows = [_row(s, a, trajectory(recs)) for s, arms in records.items() for a, recs in arms.items()]
    lines = _md_table(rows, COLUMNS)
    return ("\nEach run's course (qurl/research/studies/trajectories.py): accuracy in points at each "
            f"training evaluation, greedy at the last, mean reward per {WINDOW}-step block, mean "
            "KL(behav‖prox), and the share of 8-bit codes changed per sync in the UAQ-scaled "
            "layers / the others:\n\n" + "\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    """Print the table for metrics.jsonl files or run directories (one row each), loose or packed in
    a study's archive (qurl/research/studies/records.py)."""
    from qurl.research.studies.records import open_records

    if not argv:
        print("usage: python -m qurl.research.studies.trajectories METRICS_OR_RUN_DIR...", file=sys.stderr)
        return 2
    records: dict[Any, dict[str, list[dict]]] = {}
    for arg in argv:
        path = Path(arg)
        rec = open_records(path)
        if path.is_dir() or rec.exists("metrics.jsonl"):
            where, name = path, "metrics.jsonl"
        else:
            where, name = path.parent, path.name
            rec = open_records(where)
        if not rec.exists(name):
            print(f"{arg}: no metrics.jsonl", file=sys.stderr)
            return 2
        with rec.on_disk(name) as d:
            records.setdefault("—", {})[str(where)] = read_metrics(d / name)
    print(trajectories_markdown(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
