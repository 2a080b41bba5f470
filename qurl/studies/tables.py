"""The ablation's numbers: per-run rows from metrics records, collapse detection, the summary over
seeds, paired differences, and their markdown/csv files.

Definitions (every mean over steps is over the run's train records, NaN-free values only):

- **acc_initial / acc_final**: held-out greedy accuracy of the first (step 0) and last evaluation.
- **reward_last**: mean training reward over the last `WINDOW` steps.
- **collapse step**: let m_t be the mean training reward over steps t-WINDOW+1 .. t (a trailing
  window, defined from the WINDOW-th step on) and r0 the mean over the first WINDOW steps. The run
  collapsed at step t if m_u < COLLAPSE_FRAC * r0 for every u >= t up to the end of the run, t
  the earliest such step: the reward fell below half its starting level and never came back.
  A run with r0 <= 0 (nothing to fall from) or fewer than WINDOW steps never collapses.
- **kl, flip, clip_low/high, trunc, acr_widened, rho_max**: means over steps of
  `kl_behav_prox` (k3 estimate of KL(π_behav‖π_prox)), `flip_frac` (share of 8-bit codes that
  changed at a sync), `clip_frac_low/high`, `tis_trunc_frac`, `acr_widened_frac` and
  `is_ratio_max` (the largest ρ = π_prox/π_behav of the step).
- **acc_vs_base**: an arm's final accuracy minus the baseline's in the same seed, mean and sample sd
  over the seeds where both ran (a paired difference: the seed's base model and data are shared).
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Sequence

from qurl.studies.compare import _fmt, _md_table, _mean, _sd

WINDOW = 10
COLLAPSE_FRAC = 0.5
STEP_MEANS = {"kl": "kl_behav_prox", "flip": "flip_frac", "clip_low": "clip_frac_low",
              "clip_high": "clip_frac_high", "trunc": "tis_trunc_frac",
              "acr_widened": "acr_widened_frac", "rho_max": "is_ratio_max"}


def collapse_step(steps: Sequence[int], rewards: Sequence[float], *, window: int = WINDOW,
                  frac: float = COLLAPSE_FRAC) -> int | None:
    """The step at which training reward collapsed for good (module docstring), or None."""
    if len(steps) != len(rewards):
        raise ValueError(f"collapse_step: {len(steps)} steps but {len(rewards)} rewards")
    if len(rewards) < window:
        return None
    r0 = sum(rewards[:window]) / window
    if not r0 > 0:
        return None
    found = None
    for i in range(len(rewards) - 1, window - 2, -1):  # walk back while the window stays low
        if sum(rewards[i - window + 1 : i + 1]) / window < frac * r0:
            found = steps[i]
        else:
            break
    return found


def run_row(records: list[dict]) -> dict[str, Any]:
    """One (seed, arm) row from its metrics records."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train or not evals:
        raise ValueError("metrics have no train or no eval records")
    rewards = [float(r["reward"]) for r in train]
    row: dict[str, Any] = {
        "steps": len(train), "acc_initial": evals[0]["accuracy"], "acc_final": evals[-1]["accuracy"],
        "reward_first": _mean(rewards[:WINDOW]), "reward_last": _mean(rewards[-WINDOW:]),
        "collapse_step": collapse_step([r["step"] for r in train], rewards),
    }
    for name, key in STEP_MEANS.items():
        row[name] = _mean([r.get(key) for r in train])
    return row


def seed_rows(records: dict[int, dict[str, list[dict]]]) -> list[dict[str, Any]]:
    """{seed: {arm: records}} -> one row per (seed, arm)."""
    return [{"seed": s, "arm": a, **run_row(recs)} for s, arms in records.items()
            for a, recs in arms.items()]


def _paired(rows: list[dict], arm: str, ref: str, key: str) -> list[float]:
    by = {(r["seed"], r["arm"]): r for r in rows}
    return [by[(s, arm)][key] - by[(s, ref)][key] for s, a in by if a == arm and (s, ref) in by]


def summarize(rows: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """One row per arm over its seeds (module docstring for the columns)."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        acc = [r["acc_final"] for r in mine]
        delta = _paired(rows, arm, baseline, "acc_final") if arm != baseline else []
        collapsed = [r["collapse_step"] for r in mine if r["collapse_step"] is not None]
        out.append({
            "arm": arm, "seeds": len(mine), "steps": mine[0]["steps"],
            "acc_initial": _mean([r["acc_initial"] for r in mine]),
            "acc_final": _mean(acc), "acc_final_sd": _sd(acc),
            "acc_vs_base": _mean(delta), "acc_vs_base_sd": _sd(delta),
            "reward_last": _mean([r["reward_last"] for r in mine]),
            "collapsed": f"{len(collapsed)}/{len(mine)}",
            "collapse_step": _mean([float(c) for c in collapsed]),
            **{k: _mean([r[k] for r in mine]) for k in STEP_MEANS},
        })
    return out


def pair_rows(rows: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Paired differences (mean, sd over seeds) of final accuracy and last-window reward:
    each 8-bit format's naive and acr+uaq vs the baseline, acr vs tis, acr+uaq vs acr."""
    arms = set(r["arm"] for r in rows)
    out = []
    for q in ("int8", "fp8", "w4a16"):
        for arm, ref in ((f"{q}-naive", baseline), (f"{q}-acr-uaq", baseline),
                         (f"{q}-acr", f"{q}-tis"), (f"{q}-acr-uaq", f"{q}-acr")):
            if arm in arms and ref in arms:
                acc, rew = _paired(rows, arm, ref, "acc_final"), _paired(rows, arm, ref, "reward_last")
                out.append({"difference": f"{arm} − {ref}", "seeds": len(acc),
                            "acc_mean": _mean(acc), "acc_sd": _sd(acc),
                            "reward_mean": _mean(rew), "reward_sd": _sd(rew)})
    return out


def _csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)


def _pm(mean: float, sd: float) -> str:
    return _fmt(mean) if not math.isfinite(sd) else f"{_fmt(mean)} ± {_fmt(sd)}"


def markdown(summary: list[dict[str, Any]], pairs: list[dict[str, Any]], seeds: list[int]) -> str:
    """The results table (accuracy as points: ×100) and the paired differences."""
    table = [{"arm": r["arm"], "seeds": r["seeds"], "steps": r["steps"],
              "acc start": _fmt(100 * r["acc_initial"]),
              "acc final": _pm(100 * r["acc_final"], 100 * r["acc_final_sd"]),
              "Δ vs bf16 (paired)": _pm(100 * r["acc_vs_base"], 100 * r["acc_vs_base_sd"]),
              "reward last": _fmt(r["reward_last"]), "collapsed": r["collapsed"],
              "collapse step": _fmt(r["collapse_step"]), "KL(b‖p)": _fmt(r["kl"]),
              "flip": _fmt(r["flip"]), "clip lo/hi": f"{_fmt(r['clip_low'])} / {_fmt(r['clip_high'])}",
              "trunc": _fmt(r["trunc"]), "ACR widened": _fmt(r["acr_widened"]),
              "max ρ": _fmt(r["rho_max"])} for r in summary]
    diffs = [{"difference": p["difference"], "seeds": p["seeds"],
              "final acc (points)": _pm(100 * p["acc_mean"], 100 * p["acc_sd"]),
              "reward last": _pm(p["reward_mean"], p["reward_sd"])} for p in pairs]
    lines = [f"Seeds {', '.join(map(str, seeds))}. Accuracy in points (greedy, held-out), mean ± "
             "sample sd over seeds; collapse, KL and fractions as defined in "
             "qurl/studies/tables.py.", "", *_md_table(table, list(table[0]))]
    if diffs:
        lines += ["", "Paired differences (same seed), mean ± sd over seeds:", "",
                  *_md_table(diffs, list(diffs[0]))]
    return "\n".join(lines) + "\n"


def write_tables(records: dict[int, dict[str, list[dict]]], out: Path, *, baseline: str) -> Path:
    """ablation.md / .csv, ablation_seeds.csv, ablation_pairs.csv into out; returns ablation.md."""
    rows = seed_rows(records)
    summary, pairs = summarize(rows, baseline), pair_rows(rows, baseline)
    out.mkdir(parents=True, exist_ok=True)
    _csv(rows, out / "ablation_seeds.csv")
    _csv(summary, out / "ablation.csv")
    if pairs:
        _csv(pairs, out / "ablation_pairs.csv")
    path = out / "ablation.md"
    path.write_text("# qurl study ablation\n\n" + markdown(summary, pairs, list(records)))
    return path
