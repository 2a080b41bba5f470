"""The paper's claims checked on study rows (qurl/research/studies/claims.py), on hand-worked cases."""
from __future__ import annotations

import math

import pytest

from qurl.research.studies.claims import claims_markdown, degrades, match_claim, naive_claim, seeds_needed


def row(seed: int, arm: str, acc: float, *, collapse: int | None = None,
        curve: list[tuple[int, float]] | None = None, kl: tuple[float, float] = (0.02, 0.02)) -> dict:
    return {"seed": seed, "arm": arm, "acc_final": acc, "collapse_step": collapse, "eval_n": 200,
            "_curve": curve or [(0, 0.5), (40, acc)], "steps": 40, "kl_first": kl[0],
            "kl_last": kl[1]}


def test_naive_counts_seeds_ten_points_below_or_collapsed():
    rows = [row(0, "bf16-ppo", 0.70), row(0, "int8-naive", 0.65),  # Δ −5, no collapse: no
            row(1, "bf16-ppo", 0.60), row(1, "int8-naive", 0.55, collapse=23),  # collapsed: yes
            row(2, "bf16-ppo", 0.60), row(2, "int8-naive", 0.49),  # Δ −11: yes
            row(3, "int8-naive", 0.10)]  # no bf16 in seed 3: not paired
    got = naive_claim(rows, "int8-naive", "bf16-ppo")
    assert (got["seeds"], got["holds"]) == (3, 2)
    assert got["deltas"] == pytest.approx([-0.05, -0.05, -0.11])
    assert naive_claim(rows, "fp8-naive", "bf16-ppo") is None


@pytest.mark.parametrize("accs, verdict, mean, se", [
    # Δ = −0.5, +0.5 points: mean 0, sd 0.707, se 0.5 -> [−1, 1] inside ±2
    ((0.695, 0.705), "holds", 0.0, 0.005),
    # Δ = −10, −8: mean −9, se 1 -> [−11, −7], wholly below −2
    ((0.60, 0.62), "does not hold", -0.09, 0.01),
    # Δ = 0, −6: mean −3, sd 4.243, se 3 -> [−9, 3], wider than the claim
    ((0.70, 0.64), "not resolved", -0.03, 0.03),
])
def test_match_verdict_from_the_paired_interval(accs, verdict, mean, se):
    rows = [row(0, "bf16-ppo", 0.70), row(1, "bf16-ppo", 0.70),
            row(0, "int8-acr-uaq", accs[0]), row(1, "int8-acr-uaq", accs[1])]
    got = match_claim(rows, "int8-acr-uaq", "bf16-ppo")
    assert got["verdict"] == verdict and got["seeds"] == 2
    assert got["mean"] == pytest.approx(mean, abs=1e-12) and got["se"] == pytest.approx(se)
    assert (got["lo"], got["hi"]) == pytest.approx((mean - 2 * se, mean + 2 * se))


def test_not_resolved_projects_the_seeds_today_s_spread_would_need():
    # Δ = 0, −10 points: mean −5, sd 7.071, margin |5 − 2| = 3 -> n > (2·7.071/3)² = 22.2: 23 seeds
    rows = [row(0, "bf16-ppo", 0.70), row(1, "bf16-ppo", 0.70),
            row(0, "int8-acr-uaq", 0.70), row(1, "int8-acr-uaq", 0.60)]
    got = match_claim(rows, "int8-acr-uaq", "bf16-ppo")
    assert got["verdict"] == "not resolved" and got["seeds_needed"] == 23
    # at 23 seeds se = 7.071/√23 = 1.474 and the interval's top −5 + 2.95 = −2.05 clears −2;
    # at 22 it is −5 + 3.015 = −1.985, still inside
    assert -0.05 + 2 * 0.07071 / math.sqrt(23) < -0.02 < -0.05 + 2 * 0.07071 / math.sqrt(22)
    md = claims_markdown(rows, "bf16-ppo")
    assert "not resolved (at this mean and sd, ~23 seeds would read 'does not hold') |" in md
    # |mean| below the gap projects toward "holds": mean −1, margin 1, sd 2 -> n > 16: 17
    assert seeds_needed(-0.01, 0.02) == 17
    assert seeds_needed(0.02, 0.05) is None  # on the boundary no seed count separates it
    # resolved verdicts carry no projection
    assert match_claim(rows[:2] + [row(0, "int8-acr-uaq", 0.60), row(1, "int8-acr-uaq", 0.62)],
                       "int8-acr-uaq", "bf16-ppo")["seeds_needed"] is None


def test_match_with_one_seed_uses_the_evaluation_se():
    rows = [row(0, "bf16-ppo", 0.70), row(0, "int8-acr-uaq", 0.69)]  # Δ −1 point
    got = match_claim(rows, "int8-acr-uaq", "bf16-ppo", eval_se=0.004)  # [−1.8, −0.2]
    assert got["verdict"] == "holds in this seed (its trajectory's spread unmeasured)"
    assert got["se"] == 0.004
    assert match_claim(rows, "int8-acr-uaq", "bf16-ppo",
                       eval_se=0.006)["verdict"].startswith("not resolved in this seed")
    assert match_claim(rows, "int8-acr-uaq", "bf16-ppo")["verdict"].startswith("not resolved (no")


def test_degrades_past_two_evaluation_se_below_the_best():
    # best 0.7 over 200 questions: se sqrt(0.21/200) = 0.0324, so the bar is 0.7 − 0.0648 = 0.635
    assert degrades(row(0, "int8-tis", 0.60, curve=[(0, 0.5), (10, 0.7), (20, 0.60)]))
    assert not degrades(row(0, "int8-tis", 0.64, curve=[(0, 0.5), (10, 0.7), (20, 0.64)]))
    assert not degrades(row(0, "int8-tis", 0.80, curve=[(0, 0.5), (10, 0.7), (20, 0.80)]))
    assert degrades(row(0, "int8-tis", 0.80, collapse=30))  # a collapsed reward is degrading
    assert math.isclose(0.7 - 2 * math.sqrt(0.7 * 0.3 / 200), 0.635192, abs_tol=1e-6)


def test_claims_markdown_rows_per_format():
    rows = [row(0, "bf16-ppo", 0.70), row(0, "int8-naive", 0.06, collapse=23),
            row(0, "int8-acr-uaq", 0.69), row(0, "int8-tis", 0.67, kl=(0.02, 0.01))]
    md = claims_markdown(rows, "bf16-ppo", {"int8-acr-uaq": 0.004})
    assert "| int8 naive ≥ 10 points below bf16, or collapsed | int8-naive | 1 | Δ -64 | " \
           "holds in 1 of 1 seeds |" in md
    assert "| int8-acr-uaq | 1 | Δ -1 ± 0.4 (evaluation only, one seed); ±2 se: [-1.8, -0.2] " \
           "| holds in this seed" in md
    assert "| int8-tis | 1 | 40 steps; KL last/first 0.5 | holds in 0 of 1 seeds |" in md
    assert "fp8" not in md
    assert claims_markdown([row(0, "bf16-ppo", 0.7)], "bf16-ppo") == ""
