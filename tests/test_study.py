"""`qurl study ablation`: arm selection and configs, collapse detection, and the summary over seeds
from hand-made metrics records (no training here)."""
from __future__ import annotations

import csv
import math

import pytest

from qurl.config import load_config
from qurl.research.studies.ablation import ARM_NAMES, DEFAULT_ARMS, arm_configs, select_arms
from qurl.research.studies.page import write_tables
from qurl.research.studies.tables import (collapse_step, learned_interval, pair_rows, run_row, seed_rows,
                                 summarize)


def _records(rewards: list[float], accs: list[float], kl: float = 1e-3, flip: float = 0.05,
             clip: float = 0.01, capped: list[float] | None = None) -> list[dict]:
    """A run: an eval at step 0, one train record per reward, evals spread over the run;
    capped: each step's share of rollouts cut at the token cap (`truncated_frac`), else none."""
    n = len(rewards)
    recs = [{"kind": "eval", "step": 0, "accuracy": accs[0]}]
    for i, r in enumerate(rewards, start=1):
        recs.append({"kind": "train", "step": i, "reward": r, "kl_behav_prox": kl,
                     "flip_frac": flip, "clip_frac_low": clip, "clip_frac_high": clip / 2,
                     "tis_trunc_frac": 0.0, "acr_widened_frac": 0.0, "is_ratio_max": 1.5,
                     "cut/icepop": 0.01 * i, "cut/geomask": 0.5})
        if capped is not None:
            recs[-1]["truncated_frac"] = capped[i - 1]
    for j, a in enumerate(accs[1:], start=1):
        recs.append({"kind": "eval", "step": n * j // (len(accs) - 1), "accuracy": a})
    return recs


def test_select_arms_groups_and_errors():
    assert select_arms("") == list(DEFAULT_ARMS)
    assert len(DEFAULT_ARMS) == 9 and not any(a.startswith("w4a16") for a in DEFAULT_ARMS)
    assert select_arms("int8-field,fp8-mis") == ["int8-icepop", "int8-mis", "int8-seqtis",
                                                 "int8-geomask", "fp8-mis"]
    assert select_arms("w4a16,bf16-ppo")[1:] == ["w4a16-naive", "w4a16-tis", "w4a16-acr",
                                                 "w4a16-acr-uaq"]
    assert select_arms("int8") == ["int8-naive", "int8-tis", "int8-acr", "int8-acr-uaq"]
    assert select_arms("fp8-acr,bf16-ppo") == ["bf16-ppo", "fp8-acr"]  # ARMS order
    with pytest.raises(ValueError, match="int2-naive"):
        select_arms("bf16-ppo,int2-naive")


def test_arm_configs_differ_only_in_precision_loss_and_uaq(tmp_path):
    cfg = load_config(sets=["run.steps=7", "algo.uaq_scale=1.0", "algo.correction.cap=1.3"])
    arms = arm_configs(cfg, tmp_path, list(ARM_NAMES))
    base, naive = arms["bf16-ppo"], arms["int8-naive"]
    assert (base.rollout.precision, base.algo.loss, base.algo.uaq_scale) == ("bf16", "ppo", 1.0)
    assert (naive.rollout.precision, naive.algo.loss, naive.algo.uaq_scale) == ("int8", "naive", 1.0)
    assert arms["fp8-acr"].algo.uaq_scale == 1.0
    assert arms["fp8-acr-uaq"].algo.uaq_scale == 1.5  # config had UAQ off: the study's default s
    uaq = arms["bf16-ppo-uaq"]  # the control: the baseline with UAQ's scaling
    assert (uaq.rollout.precision, uaq.algo.loss, uaq.algo.uaq_scale) == ("bf16", "ppo", 1.5)
    assert {a.run.steps for a in arms.values()} == {7}
    assert {a.algo.correction.cap for a in arms.values()} == {1.3}
    assert {a.deploy.dir for a in arms.values()} == {str(tmp_path)}
    assert sorted(a.run.name for a in arms.values()) == sorted(ARM_NAMES)
    for c in ("icepop", "mis", "seqtis", "geomask"):  # the field's corrections: UAQ off, like tis
        for q in ("int8", "fp8", "w4a16"):
            a = arms[f"{q}-{c}"]
            assert (a.rollout.precision, a.algo.loss, a.algo.uaq_scale) == (q, c, 1.0)


def test_collapse_step_needs_a_fall_that_does_not_recover():
    steps = list(range(1, 41))
    flat = [0.6] * 40
    assert collapse_step(steps, flat) is None
    # falls to 0 from step 21 on: the 10-step trailing mean drops below 0.3 once >5 zeros are in it
    fall = [0.6] * 20 + [0.0] * 20
    assert collapse_step(steps, fall) == 26  # window 17..26 holds 6 zeros: mean 0.24 < 0.3
    # the same fall, recovered at the end: not a collapse
    recovered = [0.6] * 20 + [0.0] * 10 + [0.6] * 10
    assert collapse_step(steps, recovered) is None
    # a dip below half that comes back, then a final collapse: the final one counts
    late = [0.6] * 10 + [0.0] * 8 + [0.6] * 12 + [0.0] * 10
    assert collapse_step(steps, late) == 36
    assert collapse_step(steps[:5], [0.5] * 5) is None  # shorter than the window
    assert collapse_step(steps, [0.0] * 40) is None  # nothing to fall from
    with pytest.raises(ValueError, match="40 steps but 39"):
        collapse_step(steps, flat[:39])


def test_run_row_means_and_ends():
    row = run_row(_records([0.2] * 10 + [0.4] * 20 + [0.8] * 10, [0.3, 0.5, 0.7], kl=2e-3))
    assert row["steps"] == 40
    assert (row["acc_initial"], row["acc_final"]) == (0.3, 0.7)
    assert row["reward_first"] == pytest.approx(0.2) and row["reward_last"] == pytest.approx(0.8)
    assert row["kl"] == pytest.approx(2e-3) and row["clip_high"] == pytest.approx(0.005)
    assert row["collapse_step"] is None
    assert row["learned_step"] == 20  # evals at 0 / 20 / 40: 0.3, 0.5, 0.7; 0.5 reaches 50%
    assert run_row(_records([0.2] * 40, [0.3, 0.45, 0.49]))["learned_step"] is None
    assert math.isnan(row["capped_last"])  # no truncated_frac recorded: not 0


def test_capped_last_is_the_last_window_of_cut_rollouts():
    # 30 steps with 1 in 10 rollouts cut, then 10 with 8 in 10: the last window's mean is 0.8
    row = run_row(_records([0.5] * 40, [0.3, 0.6], capped=[0.1] * 30 + [0.8] * 10))
    assert row["capped_last"] == pytest.approx(0.8)
    row = run_row(_records([0.5] * 40, [0.3, 0.6], capped=[0.1] * 35 + [0.8] * 5))
    assert row["capped_last"] == pytest.approx((5 * 0.1 + 5 * 0.8) / 10)
    other = run_row(_records([0.5] * 40, [0.3, 0.6], capped=[0.0] * 40))
    summary = summarize([{"seed": 0, "arm": "bf16-ppo", **other},
                         {"seed": 1, "arm": "bf16-ppo", **row}], "bf16-ppo")
    assert summary[0]["capped_last"] == pytest.approx(0.45 / 2)  # mean over the two seeds
    with pytest.raises(ValueError, match="no train or no eval"):
        run_row([{"kind": "eval", "step": 0, "accuracy": 0.5}])


def test_summary_pairs_seeds_and_flags_collapse(tmp_path):
    ok, dead = [0.6] * 40, [0.6] * 20 + [0.0] * 20
    records = {
        0: {"bf16-ppo": _records(ok, [0.5, 0.60]), "int8-naive": _records(dead, [0.5, 0.20]),
            "int8-tis": _records(ok, [0.5, 0.55]), "int8-acr": _records(ok, [0.5, 0.58])},
        1: {"bf16-ppo": _records(ok, [0.5, 0.70]), "int8-naive": _records(ok, [0.5, 0.60]),
            "int8-tis": _records(ok, [0.5, 0.61]), "int8-acr": _records(ok, [0.5, 0.66]),
            "bf16-ppo-uaq": _records(ok, [0.5, 0.64])},
    }
    rows = seed_rows(records)
    by = {r["arm"]: r for r in summarize(rows, "bf16-ppo")}
    assert by["bf16-ppo"]["acc_final"] == pytest.approx(0.65)
    assert by["bf16-ppo"]["acc_final_sd"] == pytest.approx(math.sqrt(0.005))  # (0.6, 0.7): n-1
    assert math.isnan(by["bf16-ppo"]["acc_vs_base"])
    # paired: (0.2 - 0.6, 0.6 - 0.7) = (-0.4, -0.1)
    assert by["int8-naive"]["acc_vs_base"] == pytest.approx(-0.25)
    assert by["int8-naive"]["acc_vs_base_sd"] == pytest.approx(math.sqrt(0.045))
    assert by["int8-naive"]["collapsed"] == "1/2" and by["int8-naive"]["collapse_step"] == 26
    assert by["int8-acr"]["collapsed"] == "0/2" and math.isnan(by["int8-acr"]["collapse_step"])
    # every run starts at 50%: greedy ≥ 50% from step 0
    assert (by["bf16-ppo"]["learned"], by["bf16-ppo"]["learned_step"]) == ("2/2", 0.0)
    pairs = {p["difference"]: p for p in pair_rows(rows, "bf16-ppo")}
    assert set(pairs) == {"int8-naive − bf16-ppo", "int8-acr − int8-tis",  # no acr-uaq arm here
                          "bf16-ppo-uaq − bf16-ppo"}
    assert pairs["int8-acr − int8-tis"]["acc_mean"] == pytest.approx(0.04)  # (0.03, 0.05)
    # the UAQ control on seed 1 only: one pair, -0.06, no sd
    assert (pairs["bf16-ppo-uaq − bf16-ppo"]["seeds"], pairs["bf16-ppo-uaq − bf16-ppo"]["acc_mean"]
            ) == (1, pytest.approx(-0.06))
    md = write_tables(records, tmp_path, baseline="bf16-ppo").read_text()
    # Δ vs bf16: mean −25 points, se = sd/√2 = 21.2/√2 = 15
    assert "| int8-naive | 2 | 40 | 50 | 40 ± 28.3 | -25 ± 15 |" in md
    assert by["int8-naive"]["acc_vs_base_se"] == pytest.approx(math.sqrt(0.045) / math.sqrt(2))
    with (tmp_path / "ablation_seeds.csv").open() as f:
        seeds_csv = list(csv.DictReader(f))
    assert len(seeds_csv) == 9  # 4 arms on 2 seeds + the UAQ control on one
    assert [r["collapse_step"] for r in seeds_csv if r["arm"] == "int8-naive"] == ["26", ""]


def test_the_uaq_control_pairs_with_the_8bit_uaq_arm():
    """fp8-acr-uaq is paired with bf16-ppo-uaq (the same scaled weights, rolled out in bf16) as
    well as with bf16-ppo: the first difference is what 8-bit rollout adds once UAQ is in."""
    ok = [0.6] * 10
    finals = {4: {"bf16-ppo": 0.75, "bf16-ppo-uaq": 0.69, "fp8-acr-uaq": 0.68},
              5: {"bf16-ppo": 0.79, "bf16-ppo-uaq": 0.70, "fp8-acr-uaq": 0.52},
              6: {"bf16-ppo": 0.84, "fp8-acr-uaq": 0.74}}  # no control on seed 6: not paired
    rows = seed_rows({s: {a: _records(ok, [0.5, f]) for a, f in arms.items()}
                      for s, arms in finals.items()})
    pairs = {p["difference"]: p for p in pair_rows(rows, "bf16-ppo")}
    ctl = pairs["fp8-acr-uaq − bf16-ppo-uaq"]
    # per seed: 0.68 - 0.69 = -0.01, 0.52 - 0.70 = -0.18: mean -0.095, sd 0.17/√2, se 0.17/2
    assert ctl["seeds"] == 2 and ctl["acc_mean"] == pytest.approx(-0.095)
    assert ctl["acc_sd"] == pytest.approx(0.17 / math.sqrt(2))
    assert ctl["acc_se"] == pytest.approx(0.085)
    # vs bf16-ppo all three seeds pair: -0.07, -0.27, -0.10
    assert (pairs["fp8-acr-uaq − bf16-ppo"]["seeds"], pairs["fp8-acr-uaq − bf16-ppo"]["acc_mean"]
            ) == (3, pytest.approx(-0.44 / 3))
    assert "int8-acr-uaq − bf16-ppo-uaq" not in pairs  # no such arm


def test_learned_counts_the_seeds_that_reached_half_and_when(tmp_path):
    """Greedy ≥ 50% first at step 20 (seed 0) and 40 (seed 1) for bf16; naive in seed 1 only."""
    flat = [0.3] * 40
    records = {0: {"bf16-ppo": _records(flat, [0.1, 0.9, 0.95]),
                   "int8-naive": _records(flat, [0.1, 0.2, 0.3])},
               1: {"bf16-ppo": _records(flat, [0.1, 0.2, 0.5]),
                   "int8-naive": _records(flat, [0.1, 0.6, 0.4])}}  # reached, then fell back
    by = {r["arm"]: r for r in summarize(seed_rows(records), "bf16-ppo")}
    assert (by["bf16-ppo"]["learned"], by["bf16-ppo"]["learned_step"]) == ("2/2", 30.0)
    assert (by["int8-naive"]["learned"], by["int8-naive"]["learned_step"]) == ("1/2", 20.0)
    md = write_tables(records, tmp_path, baseline="bf16-ppo").read_text()
    # exact 95% intervals: 2/2 -> [0.025^(1/2), 1], 1/2 -> [1 - 0.975^(1/2), 0.975^(1/2)]
    assert "| 2/2 (16–100%), step 30 |" in md and "| 1/2 (1–99%), step 20 |" in md
    records[1]["int8-naive"] = _records(flat, [0.1, 0.2, 0.3])
    assert "| 0/2 (0–84%) |" in write_tables(records, tmp_path, baseline="bf16-ppo").read_text()


def test_learned_interval_is_clopper_pearson():
    """Closed forms: k = 0 -> hi = 1 − (a/2)^(1/n); k = n -> lo = (a/2)^(1/n); n = 2, k = 1 ->
    lo = 1 − sqrt(1 − a/2), hi = sqrt(1 − a/2). n = 10, k = 3: the tabulated [0.0667, 0.6525]."""
    assert learned_interval(0, 3) == (0.0, pytest.approx(1 - 0.025 ** (1 / 3), abs=1e-9))
    assert learned_interval(3, 3) == (pytest.approx(0.025 ** (1 / 3), abs=1e-9), 1.0)
    assert learned_interval(1, 2) == pytest.approx((1 - math.sqrt(0.975), math.sqrt(0.975)), abs=1e-9)
    assert learned_interval(3, 10) == pytest.approx((0.0667, 0.6525), abs=1e-4)
    for bad in ((4, 3), (-1, 3), (0, 0)):
        with pytest.raises(ValueError):
            learned_interval(*bad)


@pytest.mark.parametrize("argv,said", [(["--arms", "int2-naive"], "int2-naive"),
                                       (["--jobs", "0"], "--jobs 0"),
                                       (["--table-only", "--out", "/nonexistent/qurl-study"],
                                        "no finished arm")])
def test_study_cli_refuses_bad_arms_and_jobs_in_one_line(argv, said, capsys):
    from qurl.cli import main

    assert main(["study", "ablation", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0]


def test_avg_at_k_is_the_headline_and_eval_se_and_field_pairs(tmp_path):
    """With eval.samples = k the table reports Avg@k (less noisy than greedy); eval se is
    sqrt(p(1-p)/n); each field correction is paired with ACR of its format."""
    def run(avg_final, greedy_final, n=400.0):
        recs = _records([0.6] * 12, [0.5, greedy_final])
        for r in recs:
            if r["kind"] == "eval":
                r.update({"n": n, "eval/mean/greedy": r["accuracy"],
                          "eval/mean/avg@4": avg_final if r["step"] else 0.4})
        return recs

    records = {s: {"bf16-ppo": run(0.60 + d, 0.7), "int8-acr": run(0.55 + d, 0.3),
                   "int8-icepop": run(0.50 + 2 * d, 0.2)} for s, d in ((0, 0.0), (1, 0.02), (2, 0.04))}
    rows = seed_rows(records)
    assert {r["acc_metric"] for r in rows} == {"avg@4"} and rows[0]["greedy_final"] == 0.7
    by = {r["arm"]: r for r in summarize(rows, "bf16-ppo")}
    assert by["bf16-ppo"]["acc_final"] == pytest.approx(0.62)  # Avg@4, not greedy 0.7
    assert by["bf16-ppo"]["acc_initial"] == pytest.approx(0.4)
    assert by["bf16-ppo"]["eval_se"] == pytest.approx(math.sqrt(0.62 * 0.38 / 400))
    # icepop − bf16 per seed: −0.10, −0.08, −0.06: mean −0.08, sd 0.02, se 0.02/√3
    assert by["int8-icepop"]["acc_vs_base"] == pytest.approx(-0.08)
    assert by["int8-icepop"]["acc_vs_base_se"] == pytest.approx(0.02 / math.sqrt(3))
    pairs = {p["difference"]: p for p in pair_rows(rows, "bf16-ppo")}
    # icepop − acr per seed: −0.05, −0.03, −0.01
    assert pairs["int8-icepop − int8-acr"]["acc_mean"] == pytest.approx(-0.03)
    assert pairs["int8-icepop − int8-acr"]["acc_se"] == pytest.approx(0.02 / math.sqrt(3))
    md = write_tables(records, tmp_path, baseline="bf16-ppo").read_text()
    assert "avg@4 over 400 held-out questions" in md
    # icepop final 0.50, 0.54, 0.58: 54 ± 4 points; eval se 100·sqrt(0.54·0.46/400) = 2.49
    assert "| int8-icepop | 3 | 12 | 40 | 54 ± 4 | -8 ± 1.15 | — | 2.49 |" in md
    # what each correction would cut: steps 1..12 have cut/icepop = 0.01·step, mean 0.065
    assert by["int8-acr"]["cut_icepop"] == pytest.approx(0.065) and by["int8-acr"]["cut_geomask"] == 0.5
    assert "| int8-acr | — | 0.065 | — | — | 0.5 | — |" in md


def test_final_evaluations_are_the_final_accuracy_only_when_every_arm_has_one(tmp_path):
    """A committed final evaluation (Avg@k of the last checkpoint) replaces the last training
    eval's accuracy in every row, or in none: a table mixing the two would pair two measurements."""
    def run(acc_final, final_avg=None):
        recs = _records([0.6] * 12, [0.2, acc_final])
        if final_avg is not None:
            recs.append({"kind": "final_eval", "k": 8, "step": 12, "n": 230.0,
                         "eval/mean/greedy": acc_final, "eval/mean/avg@8": final_avg})
        return recs

    both = {0: {"bf16-ppo": run(0.5, 0.45), "int8-acr-uaq": run(0.4, 0.43)}}
    rows = {r["arm"]: r for r in seed_rows(both)}
    assert rows["int8-acr-uaq"]["acc_final"] == 0.43 and rows["int8-acr-uaq"]["eval_n"] == 230.0
    assert rows["bf16-ppo"]["acc_metric"] == "final eval avg@8"
    assert rows["bf16-ppo"]["acc_initial"] == 0.2  # the step-0 evaluation (greedy) stays
    by = {r["arm"]: r for r in summarize(list(rows.values()), "bf16-ppo")}
    assert by["int8-acr-uaq"]["acc_vs_base"] == pytest.approx(0.43 - 0.45)
    assert "final eval avg@8 over 230 held-out questions" in write_tables(
        both, tmp_path, baseline="bf16-ppo").read_text()

    one = {0: {"bf16-ppo": run(0.5, 0.45), "int8-acr-uaq": run(0.4)}}
    assert {r["acc_final"] for r in seed_rows(one)} == {0.5, 0.4}
    other_k = {0: {"bf16-ppo": run(0.5, 0.45), "int8-acr-uaq": run(0.4, 0.43)}}
    other_k[0]["int8-acr-uaq"][-1]["k"] = 4
    assert {r["acc_metric"] for r in seed_rows(other_k)} == {"greedy"}

    # runs that evaluated Avg@4 all along: the start is the step-0 Avg@4 (the same expected
    # accuracy at eval.temperature as the final Avg@8), not the step-0 greedy
    sampled = {0: {arm: run(0.5, 0.45) for arm in ("bf16-ppo", "int8-acr-uaq")}}
    for recs in sampled[0].values():
        for r in recs:
            if r["kind"] == "eval":
                r["eval/mean/avg@4"] = r["accuracy"] - 0.1
    rows = {r["arm"]: r for r in seed_rows(sampled)}
    assert rows["bf16-ppo"]["acc_initial"] == pytest.approx(0.1)
    assert rows["bf16-ppo"]["acc_metric"] == "final eval avg@8"


def test_final_evaluation_is_refused_without_the_runs_last_checkpoint(tmp_path):
    from qurl.research.studies import final_eval as fe

    assert fe.evaluate(tmp_path / "gone", tmp_path, 4, steps=10) == "no run directory"
    (tmp_path / "run" / "ckpt" / "step_000005").mkdir(parents=True)
    assert fe.evaluate(tmp_path / "run", tmp_path, 4, steps=10) == \
        "no checkpoint at step 10 (newest: 5)"
    with pytest.raises(ValueError, match="k = 0"):
        fe.eval_sets(0)
    assert not (tmp_path / fe.FINAL).exists()


def test_measured_eval_se_from_the_right_answers_per_question():
    from qurl.research.studies.tables import measured_se

    # x = c/8 = [1, 0, .5, .5]: sample variance (.25 + .25) / 3 = 1/6, se = sqrt(1/6) / 2
    one = {"synthetic/avg@8": [8, 0, 4, 4], "synthetic/greedy": [1, 1, 1, 1]}
    assert measured_se(one, "avg@8") == pytest.approx(math.sqrt(1 / 6) / 2)
    assert measured_se(one, "greedy") == 0.0
    # two sets (the accuracy is their mean): x2 = [1, 1, 0, 0], se2 = sqrt(1/3) / 2;
    # se = sqrt(se1² + se2²) / 2 = sqrt(1/24 + 1/12) / 2
    two = {**one, "b/avg@8": [8, 8, 0, 0]}
    assert measured_se(two, "avg@8") == pytest.approx(math.sqrt(1 / 24 + 1 / 12) / 2)
    assert math.isnan(measured_se({}, "avg@8")) and math.isnan(measured_se(one, "avg@4"))

    recs = _records([0.6] * 12, [0.2, 0.5])
    recs.append({"kind": "final_eval", "k": 8, "step": 12, "n": 4.0, "eval/mean/greedy": 1.0,
                 "eval/mean/avg@8": 0.5, "eval_counts": one})
    row = run_row(recs, use_final=True)
    assert row["acc_final"] == 0.5 and row["eval_se_measured"] == pytest.approx(0.2041241)
    summ = summarize([{"seed": 0, "arm": "bf16-ppo", **row}], "bf16-ppo")[0]
    assert summ["eval_se"] == pytest.approx(0.25)  # the binomial bound sqrt(.5 · .5 / 4)
    assert summ["eval_se_measured"] == pytest.approx(0.2041241)


def test_paired_eval_se_pairs_the_questions_of_a_seed():
    from qurl.research.studies.tables import paired_eval_se

    rows = [{"seed": 0, "arm": "a", "_scores": [1, 0, 1, 1]},
            {"seed": 0, "arm": "ref", "_scores": [1, 0, 0, 1]},
            {"seed": 1, "arm": "a", "_scores": [0.5, 0.5]}, {"seed": 1, "arm": "ref", "_scores": [0.5, 0.5]}]
    # seed 0: d = [0, 0, 1, 0], sample sd 0.5, se 0.25; seed 1: d = 0, se 0; mean of 2 seeds:
    # sqrt(0.25² + 0²) / 2
    assert paired_eval_se(rows, "a", "ref") == pytest.approx(0.125)
    rows[0]["_scores"] = None  # a seed without counts: not measurable
    assert math.isnan(paired_eval_se(rows, "a", "ref"))
