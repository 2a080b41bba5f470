"""qurl/research/studies/takeoff.py on hand-written records: the take-off step, the windows, the table."""
from __future__ import annotations

import json
import math

import pytest

from qurl.research.studies.takeoff import markdown, run_row, takeoff_step


def _run(tmp_path, name, rewards, entropies, evals, seed=3):
    d = tmp_path / name
    d.mkdir()
    recs = [{"kind": "eval", "step": s, "eval/mean/greedy": g, "eval_fp/mean/greedy": f}
            for s, g, f in evals[:1]]
    recs += [{"kind": "train", "step": i + 1, "reward": r, "entropy": e, "kl_behav_prox": 0.01 * (i + 1)}
             for i, (r, e) in enumerate(zip(rewards, entropies))]
    recs += [{"kind": "eval", "step": s, "eval/mean/greedy": g, "eval_fp/mean/greedy": f}
             for s, g, f in evals[1:]]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "config.toml").write_text(f"[run]\nseed = {seed}\n")
    return d


def test_takeoff_is_the_first_step_above_one_half_and_the_row_holds_its_windows(tmp_path):
    rewards = [0.1, 0.2, 0.5, 0.25, 0.75, 1.0, 1.0]  # 0.5 itself is not above: step 5 is
    entropies = [0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    run = _run(tmp_path, "a", rewards, entropies, [(0, 0.125, 0.135), (7, 0.9, 0.95)])
    row = run_row(run)
    assert row["takeoff"] == 5 and row["seed"] == 3 and row["steps"] == 7
    assert row["reward_first"] == 0.1
    assert row["reward_last"] == pytest.approx((0.5 + 0.25 + 0.75 + 1.0 + 1.0) / 5)
    assert row["entropy_5"] == 0.3 and row["entropy_last"] == pytest.approx(0.3)
    assert row["kl"] == pytest.approx(0.04)  # mean of 0.01 .. 0.07
    assert (row["greedy_first"], row["greedy_last"], row["greedy_fp_last"]) == (0.125, 0.9, 0.95)
    flat = run_row(_run(tmp_path, "b", [0.1] * 3, [float("nan"), 0.2, 0.4], [], seed=4))
    assert flat["takeoff"] is None and flat["entropy_5"] is None
    assert flat["entropy_last"] == pytest.approx(0.3) and flat["greedy_last"] is None  # NaN skipped
    table = markdown([row, flat])
    assert "| a | 3 | 7 | 5 |" in table and "| b | 4 | 3 | none |" in table
    assert "12.5% → 90.0% (13.5% → 95.0%)" in table
    assert table.endswith("Took off (reward > 0.5): 1 of 2 runs.\n")
    assert takeoff_step([{"kind": "eval", "step": 0, "reward": 1.0}]) is None  # train records only
    assert math.isnan(run_row(_run(tmp_path, "c", [0.1], [float("nan")], []))["entropy_last"])
