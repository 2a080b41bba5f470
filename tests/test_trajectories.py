"""Each run's course (qurl/research/studies/trajectories.py) from hand-made metrics records: the values are
worked out here by hand, not by the module."""
from __future__ import annotations

import json
import math

import pytest

from qurl.research.studies.page import write_tables
from qurl.research.studies.trajectories import blocks, main, trajectory


def _run(rewards: list[float], evals: list[tuple[int, float, float]], *, flips: bool = True,
         avg: bool = True) -> list[dict]:
    """Train records with the given rewards (KL 0.01 then 0.03 alternating; flips 0.003 scaled,
    0.002 other), and evals (step, avg@4, greedy)."""
    recs: list[dict] = []
    for step, a, g in evals:
        rec = {"kind": "eval", "step": step, "accuracy": g, "eval/mean/greedy": g}
        if avg:
            rec["eval/mean/avg@4"] = a
        recs.append(rec)
    for i, r in enumerate(rewards, start=1):
        rec = {"kind": "train", "step": i, "reward": r, "kl_behav_prox": 0.01 if i % 2 else 0.03}
        if flips:
            rec |= {"flip_frac/uaq_scaled": 0.003, "flip_frac/unscaled": 0.002}
        recs.append(rec)
    return sorted(recs, key=lambda r: (r["step"], r["kind"] == "eval"))


def test_blocks_average_whole_blocks_and_a_short_last_one_skipping_nan():
    assert blocks([1.0] * 10 + [0.0] * 10 + [0.5, 1.0], 10) == [1.0, 0.0, 0.75]
    # a NaN (or a missing value) is left out of its block, not counted as 0
    assert blocks([0.2, float("nan"), 0.4, None], 2) == [0.2, 0.4]
    assert math.isnan(blocks([float("nan")], 10)[0])


def test_trajectory_reads_accuracy_reward_blocks_kl_and_flips():
    rewards = [0.1] * 10 + [0.5] * 10 + [0.9] * 5
    t = trajectory(_run(rewards, [(0, 0.40, 0.45), (10, 0.50, 0.52), (25, 0.80, 0.84)]))
    assert t["steps"] == 25 and t["acc_name"] == "avg@4"
    assert t["acc"] == [(0, 0.40), (10, 0.50), (25, 0.80)]
    assert t["greedy_end"] == 0.84
    assert t["reward_blocks"] == pytest.approx([0.1, 0.5, 0.9], abs=1e-12)
    assert t["kl"] == pytest.approx((13 * 0.01 + 12 * 0.03) / 25, abs=1e-12)  # 13 odd steps
    assert (t["flip_scaled"], t["flip_other"]) == pytest.approx((0.003, 0.002), abs=1e-15)
    # without Avg@k in every evaluation the headline is greedy
    t = trajectory(_run(rewards, [(0, 0.4, 0.45), (25, 0.8, 0.84)], avg=False))
    assert t["acc_name"] == "greedy" and t["acc"] == [(0, 0.45), (25, 0.84)]


def test_the_ablation_table_carries_each_runs_course(tmp_path):
    rewards = [0.2] * 10 + [0.6] * 10
    records = {3: {"bf16-ppo": _run(rewards, [(0, 0.5, 0.5), (20, 0.9, 0.91)], flips=False),
                   "fp8-acr-uaq": _run(rewards, [(0, 0.44, 0.5), (20, 0.6, 0.62)])}}
    md = write_tables(records, tmp_path, baseline="bf16-ppo").read_text()
    assert ("| 3 | fp8-acr-uaq | 20 | 44.0 / 60.0 (avg@4 at 0 / 20) | 62.0 | 0.2 / 0.6 | 0.02 "
            "| 0.003 / 0.002 |") in md
    assert "| 3 | bf16-ppo | 20 | 50.0 / 90.0 (avg@4 at 0 / 20) | 91.0 | 0.2 / 0.6 | 0.02 | — |" in md


def test_main_reads_run_dirs_and_refuses_a_missing_one(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(
        json.dumps(r) for r in _run([0.3, 0.5], [(0, 0.1, 0.2), (2, 0.3, 0.4)])) + "\n")
    assert main([str(run)]) == 0
    assert f"| — | {run} | 2 | 10.0 / 30.0 (avg@4 at 0 / 2) | 40.0 | 0.4 |" in capsys.readouterr().out
    assert main([str(tmp_path / "nope")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
