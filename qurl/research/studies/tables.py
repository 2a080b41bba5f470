"""The ablation's numbers: per-run rows from metrics records, collapse detection, the summary over
seeds, paired differences, and their markdown/csv files.

Definitions (every mean over steps is over the run's train records, NaN-free values only):

- **acc_initial / acc_final**: held-out accuracy of the first (step 0) and last evaluation: Avg@k
  (`eval/mean/avg@k`, k = eval.samples answers per question at eval.temperature) when the run
  measured it, else greedy (`accuracy`); `acc_metric` names which, `eval_n` the questions scored.
  `greedy_final` is the greedy accuracy in either case (when measured). When every arm of the table
  has a committed final evaluation at the same k (qurl/research/studies/final_eval.py), acc_final and
  greedy_final are that evaluation's Avg@k and greedy (acc_initial stays the step-0 evaluation:
  its Avg@k at the run's own k where it measured one, the same expected accuracy at
  eval.temperature, else greedy).
- **eval_se**: the standard error of one evaluation at the arm's mean final accuracy p over n
  questions, sqrt(p(1−p)/n): exact for greedy (a binomial), an upper bound for Avg@k (the per-question
  share c/k varies less than a single 0/1 answer). It is the part of a seed-to-seed difference that
  is measurement noise; the rest is the RL trajectory's. **eval_se_measured**: where the
  evaluation kept its right answers per question (`eval_counts`, `qurl eval --per-question`; the final
  evaluations do), the standard error they measure, sd(c/k)/sqrt(n) per set (`measured_se`), as
  the root mean square over seeds in the summary. **acc_vs_base_eval_se**: the measurement noise of
  the paired difference, from the same counts: per seed sd over questions of the two arms' score
  difference / sqrt(n) (both arms of a seed answer the same questions), sqrt(Σ se_s²)/m over m
  seeds (`paired_eval_se`). Δ's se over seeds holds this noise and the trajectories' spread.
- **reward_last**: mean training reward over the last `WINDOW` steps. **capped_last**: mean
  `truncated_frac` over the same steps, the share of rollouts cut at rollout.max_new_tokens (no
  end token): a policy that keeps writing after its answer shows here, not in the reward, which
  reads the last complete boxed answer (qurl/data/rewards.py), so a run-on cut before a second
  box scores as its first. **kl_first / kl_last**:
  mean `kl_behav_prox` over the first / last `WINDOW` steps (the paper's sign of TIS failing is
  its growth). `_curve`: the training evaluations' (step, headline accuracy), for
  qurl/research/studies/claims.py.
- **learned step**: the first evaluation step whose greedy accuracy (`eval/mean/greedy`, else the
  evaluation's headline `accuracy`) reaches LEARNED_ACC, None if none did. Where learning is one jump whose step varies from run to run (the
  real-model recipe: ~10–20% → ~100% within ~10 steps), the final accuracy of a run cut before its
  jump says *when* more than *how well*; this column says which runs had learned by the end, and
  when (the summary: how many of the seeds, their exact 95% interval for the share of runs that
  learn (`learned_interval`, Clopper–Pearson), and their mean step). Three seeds resolve little:
  0/3 learned allows a true share up to 71%, 3/3 one down to 29%.
- **collapse step**: let m_t be the mean training reward over steps t-WINDOW+1 .. t (a trailing
  window, defined from the WINDOW-th step on) and r0 the mean over the first WINDOW steps. The run
  collapsed at step t if m_u < COLLAPSE_FRAC * r0 for every u >= t up to the end of the run, t
  the earliest such step: the reward fell below half its starting level and never came back.
  A run with r0 <= 0 (nothing to fall from) or fewer than WINDOW steps never collapses.
- **kl, flip, clip_low/high, trunc, mask_low/high, acr_widened, rho_max**: means over steps of
  `kl_behav_prox` (k3 estimate of KL(π_behav‖π_prox)), `flip_frac` (share of the engine's linear
  weights whose code changed at a sync: 8-bit codes for INT8/FP8 arms; for a bf16 arm the values
  on the wire, nearly all of which change every step, so ~1 there says nothing of quantization),
  `clip_frac_low/high`, `tis_trunc_frac` (share of tokens whose IS weight the correction truncated
  at its cap: tis, acr, seqtis), `mask_frac_low/high` (share it masked, weight 0, below / above
  its bounds: icepop, mis, geomask; qurl/algo/corrections.py), `acr_widened_frac`,
  `is_ratio_max` (the largest ρ = π_prox/π_behav of the step) and `is_weight_mean` (w_mean: the
  mean IS weight). **cut_<c>**: mean over steps of `cut/<c>`, the share of tokens correction c
  (tis, icepop, mis, seqtis, geomask, at the run's bounds) would truncate or mask on the arm's own
  rollouts, whatever the arm's loss: how hard each correction bites at that format's mismatch.
- **acc_vs_base**: an arm's final accuracy minus the baseline's in the same seed, over the seeds
  where both ran (a paired difference: the seed's base model and data are shared): mean, sample sd
  and standard error sd/sqrt(seeds). With d the per-seed differences, se = sd(d)/sqrt(n); a
  difference is resolved when it is well outside ±2 se.
"""
from __future__ import annotations

import csv
import io
import math
from typing import Any, Sequence

from qurl.algo.corrections import CUT_PRESETS
from qurl.research.studies.compare import _fmt, _md_table, _mean, _sd

WINDOW = 10
COLLAPSE_FRAC = 0.5
LEARNED_ACC = 0.5
STEP_MEANS = {"kl": "kl_behav_prox", "flip": "flip_frac", "clip_low": "clip_frac_low",
              "clip_high": "clip_frac_high", "trunc": "tis_trunc_frac",
              "mask_low": "mask_frac_low", "mask_high": "mask_frac_high",
              "acr_widened": "acr_widened_frac", "rho_max": "is_ratio_max",
              "w_mean": "is_weight_mean",
              **{f"cut_{c}": f"cut/{c}" for c in CUT_PRESETS}}
FIELD_CORRECTIONS = ("icepop", "mis", "seqtis", "geomask")


def acc_key(evals: list[dict]) -> tuple[str, str]:
    """(record key, name) of the headline accuracy: Avg@k if every evaluation has it, else greedy."""
    avg = sorted({k for k in evals[-1] if k.startswith("eval/mean/avg@")})
    if avg and all(avg[0] in r for r in evals):
        return avg[0], avg[0].removeprefix("eval/mean/")
    return "accuracy", "greedy"


def _se(sd: float, n: int) -> float:
    return sd / math.sqrt(n) if n > 1 and math.isfinite(sd) else float("nan")


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


def learned_step(evals: list[dict], level: float = LEARNED_ACC) -> int | None:
    """The first evaluation step whose greedy accuracy reaches `level` (module docstring)."""
    return next((int(r["step"]) for r in evals
                 if r.get("eval/mean/greedy", r["accuracy"]) >= level), None)


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _solve(f: Any, target: float) -> float:
    """The p in [0, 1] where the decreasing function f(p) equals target (bisection, 1e-12)."""
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
    return (lo + hi) / 2


def learned_interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper–Pearson) interval for a binomial share after k successes in n trials: lo
    solves P(X >= k | lo) = a/2, i.e. P(X <= k−1 | lo) = 1 − a/2, and hi solves P(X <= k | hi) = a/2
    (a = 1 − level); lo = 0 when k = 0 and hi = 1 when k = n. E.g. k = 0, n = 3: hi = 1 − 0.025^(1/3)
    = 0.708."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    a = (1 - level) / 2
    lo = 0.0 if k == 0 else _solve(lambda p: _binom_cdf(k - 1, n, p), 1 - a)
    hi = 1.0 if k == n else _solve(lambda p: _binom_cdf(k, n, p), a)
    return lo, hi


def final_eval_k(records: list[dict]) -> int | None:
    """k of the arm's committed final evaluation (a `final_eval` record), None without one."""
    return next((r["k"] for r in records if r.get("kind") == "final_eval"), None)


def measured_se(counts: dict[str, list[int]], metric: str) -> float:
    """The standard error of an accuracy from its right answers per question: for each set, the
    per-question scores x = c/k (k = 1 greedy, k for avg@k) give sd(x)/sqrt(n) (sample sd: the
    noise of drawing these questions and these answers); over S sets, whose mean the accuracy is,
    sqrt(Σ se_s²)/S. NaN when a set's counts are missing or it has under 2 questions."""
    k = 1 if metric == "greedy" else int(metric.removeprefix("avg@"))
    per_set = [[c / k for c in v] for key, v in counts.items() if key.split("/")[-1] == metric]
    if not per_set or any(len(x) < 2 for x in per_set):
        return float("nan")
    ses = [_sd(x) / math.sqrt(len(x)) for x in per_set]
    return math.sqrt(sum(se * se for se in ses)) / len(ses)


def question_scores(counts: dict[str, list[int]], metric: str) -> list[float] | None:
    """Each question's score c/k for `metric` (greedy | avg@k), every set's in order; None
    without counts."""
    k = 1 if metric == "greedy" else int(metric.removeprefix("avg@"))
    scores = [c / k for key, v in counts.items() if key.split("/")[-1] == metric for c in v]
    return scores or None


def paired_eval_se(rows: list[dict], arm: str, ref: str) -> float:
    """The measurement noise of the mean paired difference arm − ref: in each seed, both arms
    scored the same questions, so the difference's standard error is sd over questions of
    (score_arm − score_ref) / sqrt(n), the noise the two evaluations add (questions both find
    easy or hard cancel); over m seeds sqrt(Σ se_s²) / m. NaN unless every pair kept scores."""
    by = {(r["seed"], r["arm"]): r.get("_scores") for r in rows}
    ses = []
    for s, a in by:
        if a != arm or (s, ref) not in by:
            continue
        x, y = by[(s, arm)], by[(s, ref)]
        if x is None or y is None or len(x) != len(y) or len(x) < 2:
            return float("nan")
        ses.append(_sd([u - v for u, v in zip(x, y)]) / math.sqrt(len(x)))
    return math.sqrt(sum(se * se for se in ses)) / len(ses) if ses else float("nan")


def run_row(records: list[dict], *, use_final: bool = False) -> dict[str, Any]:
    """One (seed, arm) row from its metrics records; with use_final the final accuracy is the
    final evaluation's Avg@k (qurl/research/studies/final_eval.py) instead of the last training eval's."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train or not evals:
        raise ValueError("metrics have no train or no eval records")
    rewards = [float(r["reward"]) for r in train]
    key, metric = acc_key(evals)
    curve = [(int(r["step"]), float(r[key])) for r in evals if key in r]
    kl = [r.get("kl_behav_prox") for r in train]
    last, head = evals[-1], metric
    if use_final:
        last = next(r for r in records if r.get("kind") == "final_eval")
        key = f"eval/mean/avg@{last['k']}"
        metric, head = f"final eval avg@{last['k']}", f"avg@{last['k']}"
    row: dict[str, Any] = {
        "steps": len(train), "acc_metric": metric, "eval_n": last.get("n", float("nan")),
        "acc_initial": evals[0][key if key in evals[0] else acc_key(evals[:1])[0]],
        "acc_final": last[key], "greedy_final": last.get("eval/mean/greedy", float("nan")),
        "eval_se_measured": measured_se(last.get("eval_counts", {}), head),
        "_scores": question_scores(last.get("eval_counts", {}), head),
        "reward_first": _mean(rewards[:WINDOW]), "reward_last": _mean(rewards[-WINDOW:]),
        "capped_last": _mean([r.get("truncated_frac") for r in train[-WINDOW:]]),
        "collapse_step": collapse_step([r["step"] for r in train], rewards),
        "learned_step": learned_step(evals),
        "kl_first": _mean(kl[:WINDOW]), "kl_last": _mean(kl[-WINDOW:]),
        "_curve": curve,
    }
    for name, key in STEP_MEANS.items():
        row[name] = _mean([r.get(key) for r in train])
    return row


def seed_rows(records: dict[int, dict[str, list[dict]]]) -> list[dict[str, Any]]:
    """{seed: {arm: records}} -> one row per (seed, arm). The final evaluations are used only when
    every row has one at the same k: a table mixing them with training evals would compare two
    measurements in its paired differences."""
    ks = {final_eval_k(recs) for arms in records.values() for recs in arms.values()}
    use_final = len(ks) == 1 and None not in ks
    return [{"seed": s, "arm": a, **run_row(recs, use_final=use_final)}
            for s, arms in records.items() for a, recs in arms.items()]


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
        learned = [r["learned_step"] for r in mine if r["learned_step"] is not None]
        p, n = _mean(acc), _mean([float(r["eval_n"]) for r in mine])
        measured = [r["eval_se_measured"] for r in mine]
        out.append({
            "arm": arm, "seeds": len(mine), "steps": mine[0]["steps"],
            "acc_metric": "/".join(dict.fromkeys(r["acc_metric"] for r in mine)), "eval_n": n,
            "acc_initial": _mean([r["acc_initial"] for r in mine]),
            "acc_final": p, "acc_final_sd": _sd(acc),
            "eval_se": math.sqrt(p * (1 - p) / n) if n > 0 else float("nan"),
            "eval_se_measured": math.sqrt(_mean([se * se for se in measured]))
            if all(math.isfinite(se) for se in measured) else float("nan"),
            "greedy_final": _mean([r["greedy_final"] for r in mine]),
            "acc_vs_base": _mean(delta), "acc_vs_base_sd": _sd(delta),
            "acc_vs_base_se": _se(_sd(delta), len(delta)), "paired_seeds": len(delta),
            "acc_vs_base_eval_se": paired_eval_se(rows, arm, baseline)
            if arm != baseline else float("nan"),
            "reward_last": _mean([r["reward_last"] for r in mine]),
            "capped_last": _mean([r["capped_last"] for r in mine]),
            "collapsed": f"{len(collapsed)}/{len(mine)}",
            "collapse_step": _mean([float(c) for c in collapsed]),
            "learned": f"{len(learned)}/{len(mine)}",
            **dict(zip(("learned_lo", "learned_hi"), learned_interval(len(learned), len(mine)))),
            "learned_step": _mean([float(t) for t in learned]),
            **{k: _mean([r[k] for r in mine]) for k in STEP_MEANS},
        })
    return out


def pair_rows(rows: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Paired differences (mean, sd, se over seeds) of final accuracy and last-window reward:
    the baseline with UAQ vs without; each 8-bit format's naive and acr+uaq vs the baseline, acr
    vs tis, acr+uaq vs acr, acr+uaq vs the baseline with UAQ (the same scaled weights, rolled out
    8-bit or not: what quantization adds once UAQ's scaling is in), and each field correction
    (icepop, mis, seqtis, geomask) vs acr: both UAQ off, only the weight differs."""
    arms = set(r["arm"] for r in rows)
    wanted = [(f"{baseline}-uaq", baseline)]
    for q in ("int8", "fp8", "w4a16"):
        wanted += [(f"{q}-naive", baseline), (f"{q}-acr-uaq", baseline), (f"{q}-acr", f"{q}-tis"),
                   (f"{q}-acr-uaq", f"{q}-acr"), (f"{q}-acr-uaq", f"{baseline}-uaq"),
                   *((f"{q}-{c}", f"{q}-acr") for c in FIELD_CORRECTIONS)]
    out = []
    for arm, ref in wanted:
        if arm in arms and ref in arms:
            acc, rew = _paired(rows, arm, ref, "acc_final"), _paired(rows, arm, ref, "reward_last")
            out.append({"difference": f"{arm} − {ref}", "seeds": len(acc),
                        "acc_mean": _mean(acc), "acc_sd": _sd(acc), "acc_se": _se(_sd(acc), len(acc)),
                        "reward_mean": _mean(rew), "reward_sd": _sd(rew),
                        "reward_se": _se(_sd(rew), len(rew))})
    return out


def _csv(rows: list[dict[str, Any]]) -> str:
    w = csv.DictWriter(f := io.StringIO(newline=""), [k for k in rows[0] if not k.startswith("_")])
    w.writeheader()
    w.writerows({k: ("" if v is None else v) for k, v in r.items() if not k.startswith("_")}
                for r in rows)
    return f.getvalue()


def _pm(mean: float, sd: float) -> str:
    return _fmt(mean) if not math.isfinite(sd) else f"{_fmt(mean)} ± {_fmt(sd)}"


def _learned_cell(r: dict[str, Any]) -> str:
    text = f"{r['learned']} ({100 * r['learned_lo']:.0f}–{100 * r['learned_hi']:.0f}%)"
    return f"{text}, step {_fmt(r['learned_step'])}" if math.isfinite(r["learned_step"]) else text


def markdown(summary: list[dict[str, Any]], pairs: list[dict[str, Any]], seeds: list[int]) -> str:
    """The results table (accuracy as points: ×100) and the paired differences."""
    table = [{"arm": r["arm"], "seeds": r["seeds"], "steps": r["steps"],
              "acc start": _fmt(100 * r["acc_initial"]),
              "acc final ± sd": _pm(100 * r["acc_final"], 100 * r["acc_final_sd"]),
              "Δ vs bf16 ± se": _pm(100 * r["acc_vs_base"], 100 * r["acc_vs_base_se"]),
              "Δ eval se": _fmt(100 * r["acc_vs_base_eval_se"]),
              "eval se": _fmt(100 * r["eval_se"]) if not math.isfinite(r["eval_se_measured"])
              else f"{_fmt(100 * r['eval_se_measured'])} (≤ {_fmt(100 * r['eval_se'])})",
              f"greedy ≥ {_fmt(100 * LEARNED_ACC)} at": _learned_cell(r),
              "reward last": _fmt(r["reward_last"]), "capped last": _fmt(r["capped_last"]),
              "collapsed": r["collapsed"],
              "collapse step": _fmt(r["collapse_step"]), "KL(b‖p)": _fmt(r["kl"]),
              "flip": _fmt(r["flip"]), "clip lo/hi": f"{_fmt(r['clip_low'])} / {_fmt(r['clip_high'])}",
              "trunc": _fmt(r["trunc"]),
              "masked lo/hi": f"{_fmt(r['mask_low'])} / {_fmt(r['mask_high'])}",
              "ACR widened": _fmt(r["acr_widened"]), "max ρ": _fmt(r["rho_max"])} for r in summary]
    diffs = [{"difference": p["difference"], "seeds": p["seeds"],
              "final acc (points) ± se": _pm(100 * p["acc_mean"], 100 * p["acc_se"]),
              "sd": _fmt(100 * p["acc_sd"]),
              "reward last ± se": _pm(p["reward_mean"], p["reward_se"])} for p in pairs]
    how = "; ".join(dict.fromkeys(f"{r['acc_metric']} over {_fmt(r['eval_n'])} held-out questions"
                                  for r in summary))
    lines = [f"Seeds {', '.join(map(str, seeds))}. Accuracy in points ({how}): final accuracy mean "
             "± sample sd over seeds; Δ vs bf16 paired by seed, mean ± standard error; eval se: "
             "one evaluation's standard error at that accuracy (sqrt(p(1−p)/n), an upper bound "
             "for Avg@k; where the right answers per question were kept, the one they measure, "
             "sd(c/k)/sqrt(n), root mean square over seeds, with that bound after it); Δ eval se: "
             "the part of Δ's uncertainty the evaluations add, paired by question (both arms of "
             "a seed answer the same questions), over the seeds' mean. Trunc / masked: share of "
             "tokens whose IS weight the correction truncated / zeroed. Greedy ≥ 50 at: how "
             "many seeds' greedy held-out accuracy reached 50 by the end (in brackets the "
             "exact 95% interval for the share of runs that would), and their mean first step. "
             "Reward / capped last: mean training reward and "
             f"share of rollouts cut at the token cap, over the last {WINDOW} "
             "steps. Flip: share of the engine's linear weights whose code changed at a sync "
             "(8-bit codes; a bf16 arm's bf16 values, nearly all of which change every step). "
             "Collapse, KL and fractions as defined in qurl/research/studies/tables.py.",
             "", *_md_table(table, list(table[0]))]
    cuts = [{"arm": r["arm"], **{c: _fmt(r[f"cut_{c}"]) for c in CUT_PRESETS},
             "mean IS weight": _fmt(r["w_mean"])} for r in summary
            if any(math.isfinite(r[f"cut_{c}"]) for c in CUT_PRESETS)]
    if cuts:
        lines += ["", "Share of tokens each correction would truncate or mask on the arm's own "
                  "rollouts (mean over steps, at the run's bounds), and the mean IS weight of the "
                  "arm's own loss:", "", *_md_table(cuts, list(cuts[0]))]
    if diffs:
        lines += ["", "Paired differences (same seed), mean ± standard error over seeds, and sd:",
                  "", *_md_table(diffs, list(diffs[0]))]
    return "\n".join(lines) + "\n"
