"""The paper's three accuracy claims, checked on a study's runs, with a verdict each.

QuRL (arXiv 2602.13953) makes three claims that an ablation of 8-bit rollout can test:

1. **Naive collapses.** Using the quantized actor as the PPO ratio's denominator "collapses
   training within a few steps". Read as the issue states it: the naive arm ends at least
   NAIVE_GAP (10) points below bf16 in the same seed, or its reward collapsed
   (qurl/research/studies/tables.py's collapse step). Checked per seed: it holds in k of n seeds.
2. **ACR + UAQ matches bf16.** Read as: the paired difference d = acc(acr-uaq) − acc(bf16) is within
   MATCH_GAP (2) points. With n seeds, d̄ ± 2·se where se = sd(d)/√n; with one seed there is no
   spread over trajectories, so se is the evaluation's own paired standard error (both arms answer
   the same questions; only the measurement noise, so one seed understates the uncertainty).
   Verdict: *holds* when the interval lies inside ±2, *does not hold* when it lies wholly outside,
   else *not resolved* (the interval is wider than the claim); with one seed the verdict is said
   of that seed only: runs of one recipe differ by more than their evaluations do. A verdict of
   *not resolved* over several seeds comes with a projection, `seeds_needed`: the fewest seeds n
   with 2·sd/√n < | |d̄| − 2 |, i.e. how many seeds would settle it if more seeds kept today's mean
   and spread (toward *does not hold* when |d̄| > 2, *holds* when |d̄| < 2). It is a planning
   number, not a result: the next seeds move the mean and sd.
   The same test is applied to the ACR arm without UAQ (`<q>-acr`): the paper's recipe where the
   learning rate is already large (its PPO/GSM8K setting, lr 1e-5, turns UAQ off: "updates already
   large"; its DAPO ablation's "QuRL w/o UAQ" is 1.0 point below bf16). UAQ under Adam grows the
   norm-fed linears' steps relative to their weights ≈ s-fold, and the paper measured lr ×1.5 as
   worse than s = 1.5, so at lr ≥ 1e-5 this row, not ACR + UAQ's, is the paper's own setting.
3. **TIS degrades over the run.** The paper sees TIS hold for ~500 steps, then KL(behav‖prox) grow
   ~12× and training collapse. Checked per seed: the run collapsed, or its last training evaluation
   is below its best earlier one by more than 2 standard errors of an evaluation at that best
   accuracy (sqrt(p(1−p)/n), the binomial bound; an Avg@k evaluation is less noisy, so this errs
   toward "not degrading"). The table also gives KL over the last WINDOW steps ÷ the first WINDOW
   steps, the paper's sign. A run far shorter than ~500 steps is not expected to show it: a
   verdict of "no" there does not contradict the paper.

Each claim is checked for every 8-bit format (int8, fp8, w4a16) whose arms the study holds.
"""
from __future__ import annotations

import math
from typing import Any

from qurl.research.studies.compare import _fmt, _md_table, _mean, _sd
from qurl.research.studies.tables import _paired, _se

NAIVE_GAP = 0.10
MATCH_GAP = 0.02
FORMATS = ("int8", "fp8", "w4a16")


def naive_claim(rows: list[dict[str, Any]], arm: str, baseline: str) -> dict[str, Any] | None:
    """Claim 1 for `arm`: {"seeds", "holds" (seeds where it does), "deltas" (points)}; None when no
    seed has both arms."""
    based = {r["seed"] for r in rows if r["arm"] == baseline}
    mine = [r for r in rows if r["arm"] == arm and r["seed"] in based]  # _paired's order
    if not mine:
        return None
    deltas = _paired(rows, arm, baseline, "acc_final")
    holds = sum(d <= -NAIVE_GAP or r["collapse_step"] is not None for d, r in zip(deltas, mine))
    return {"seeds": len(mine), "holds": holds, "deltas": deltas}


def match_claim(rows: list[dict[str, Any]], arm: str, baseline: str,
                eval_se: float = float("nan")) -> dict[str, Any] | None:
    """Claim 2 for `arm`: {"seeds", "mean", "se", "lo", "hi", "verdict", "seeds_needed"}; eval_se
    (the paired evaluation se, tables.paired_eval_se) stands in for se with one seed. seeds_needed
    is set only for *not resolved* over several seeds (module docstring). None without a pair."""
    d = _paired(rows, arm, baseline, "acc_final")
    if not d:
        return None
    se = _se(_sd(d), len(d)) if len(d) > 1 else eval_se
    mean = _mean(d)
    lo, hi = mean - 2 * se, mean + 2 * se
    if not math.isfinite(se):
        verdict = "not resolved (no standard error)"
    elif -MATCH_GAP <= lo and hi <= MATCH_GAP:
        verdict = "holds"
    elif hi < -MATCH_GAP or lo > MATCH_GAP:
        verdict = "does not hold"
    else:
        verdict = "not resolved"
    needed = None
    if verdict == "not resolved" and len(d) > 1:
        needed = seeds_needed(mean, _sd(d))
    if len(d) == 1 and math.isfinite(se):
        verdict += " in this seed (its trajectory's spread unmeasured)"
    return {"seeds": len(d), "mean": mean, "se": se, "lo": lo, "hi": hi, "verdict": verdict,
            "seeds_needed": needed}


def seeds_needed(mean: float, sd: float, gap: float = MATCH_GAP) -> int | None:
    """The fewest seeds n with 2·sd/√n < ||mean| − gap| (module docstring); None when |mean| is
    exactly the gap (no number of seeds separates it)."""
    margin = abs(abs(mean) - gap)
    if margin == 0:
        return None
    return math.floor((2 * sd / margin) ** 2) + 1


def degrades(row: dict[str, Any]) -> bool:
    """Claim 3 for one run (module docstring): collapsed, or its last training evaluation more than
    2 evaluation standard errors below its best earlier one."""
    if row["collapse_step"] is not None:
        return True
    curve, n = row["_curve"], float(row["eval_n"])
    if len(curve) < 2 or not n > 0:
        return False
    best = max(acc for _, acc in curve[:-1])
    return curve[-1][1] < best - 2 * math.sqrt(best * (1 - best) / n)


def _projection(match: dict[str, Any]) -> str:
    """The verdict's tail for a not-resolved claim: the seeds that today's mean and sd would need."""
    n = match["seeds_needed"]
    if n is None:
        return ""
    toward = "does not hold" if abs(match["mean"]) > MATCH_GAP else "holds"
    return f" (at this mean and sd, ~{n} seeds would read '{toward}')"


def claims_markdown(rows: list[dict[str, Any]], baseline: str,
                    eval_ses: dict[str, float] | None = None) -> str:
    """The claims table for every format the rows hold ("" if none can be checked). eval_ses:
    {arm: its paired evaluation se vs the baseline}, for claim 2 with one seed."""
    arms = {r["arm"] for r in rows}
    table = []
    for q in FORMATS:
        naive = naive_claim(rows, f"{q}-naive", baseline)
        if naive:
            table.append({"claim (paper)": f"{q} naive ≥ 10 points below bf16, or collapsed",
                          "arm": f"{q}-naive", "seeds": naive["seeds"],
                          "measured": "Δ " + ", ".join(_fmt(100 * d) for d in naive["deltas"]),
                          "verdict": f"holds in {naive['holds']} of {naive['seeds']} seeds"})
        for arm, name in ((f"{q}-acr-uaq", "ACR + UAQ"), (f"{q}-acr", "ACR (UAQ off)")):
            match = match_claim(rows, arm, baseline, (eval_ses or {}).get(arm, float("nan")))
            if not match:
                continue
            se_of = "over seeds" if match["seeds"] > 1 else "evaluation only, one seed"
            table.append({"claim (paper)": f"{q} {name} within 2 points of bf16",
                          "arm": arm, "seeds": match["seeds"],
                          "measured": f"Δ {_fmt(100 * match['mean'])} ± {_fmt(100 * match['se'])} "
                                      f"({se_of}); ±2 se: [{_fmt(100 * match['lo'])}, "
                                      f"{_fmt(100 * match['hi'])}]",
                          "verdict": match["verdict"] + _projection(match)})
        tis = [r for r in rows if r["arm"] == f"{q}-tis"]
        if f"{q}-tis" in arms:
            growth = [r["kl_last"] / r["kl_first"] for r in tis if r["kl_first"] > 0]
            table.append({"claim (paper)": f"{q} TIS degrades over the run (paper: after ~500 steps)",
                          "arm": f"{q}-tis", "seeds": len(tis),
                          "measured": f"{tis[0]['steps']} steps; KL last/first "
                                      + ", ".join(_fmt(g) for g in growth),
                          "verdict": f"holds in {sum(map(degrades, tis))} of {len(tis)} seeds"})
    if not table:
        return ""
    return "\n".join(["", "The paper's claims on these runs (definitions and verdict rules: "
                      "qurl/research/studies/claims.py):", "", *_md_table(table, list(table[0]))]) + "\n"
