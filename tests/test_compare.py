"""`qurl compare`: arm configs, the table's numbers from hand-made records, and a real two-arm run.

The summary is checked against hand-worked values: steps/hour counts the training loop only, from
the end of the step-0 evaluation to the last train record, minus intermediate evaluations.
"""
from __future__ import annotations

import math

import pytest

from pipeline_helpers import tiny_cfg
from qurl.config import load_config
from qurl.metrics import read_metrics
from qurl.pipeline.compare import ARMS, arm_configs, compare, summarize, write_table


def test_arm_configs_share_everything_but_the_arm(tmp_path):
    cfg = load_config(sets=["run.seed=7", "run.steps=5"])
    arms = arm_configs(cfg, tmp_path)
    assert list(arms) == [name for name, _ in ARMS]
    a, s = arms["async1-int8-acr-uaq"], arms["sync-int8-acr-uaq"]
    assert (a.rollout.mode, a.rollout.max_staleness, s.rollout.mode) == ("async", 1, "sync")
    assert a.run.seed == s.run.seed == 7 and a.run.steps == s.run.steps == 5
    assert a.algo.uaq_scale == 1.5 and arms["sync-bf16"].algo.uaq_scale == 1.0
    assert arms["sync-int8-naive"].algo.loss == "naive"
    assert all(c.run.dir == str(tmp_path) and c.run.name == n for n, c in arms.items())
    two = arm_configs(cfg, tmp_path, ["async1-int8-acr-uaq", "sync-int8-acr-uaq"])
    assert list(two) == ["sync-int8-acr-uaq", "async1-int8-acr-uaq"]  # ARMS order
    with pytest.raises(ValueError, match="unknown"):
        arm_configs(cfg, tmp_path, ["sync-fp4"])


def _records(step_s: float, eval_s: float) -> list[dict]:
    """eval 0 ends at 10 s; 4 train steps of step_s each, an eval (eval_s) after step 2."""
    recs = [{"kind": "eval", "step": 0, "accuracy": 0.5, "wall": 10.0}]
    t = 10.0
    for step in range(1, 5):
        t += step_s
        recs.append({"kind": "train", "step": step, "reward": 0.1 * step, "kl_behav_prox": 1e-3,
                     "flip_frac": 0.02, "wall": t})
        if step == 2:
            t += eval_s
            recs.append({"kind": "eval", "step": 2, "accuracy": 0.55, "time/eval": eval_s,
                         "wall": t})
    recs.append({"kind": "eval", "step": 4, "accuracy": 0.6, "wall": t + eval_s})
    return recs


def test_summary_counts_the_training_loop_only(tmp_path):
    sync = summarize("sync-int8-acr-uaq", _records(step_s=3.0, eval_s=5.0), arm_wall_s=60.0)
    fast = summarize("async1-int8-acr-uaq", _records(step_s=2.0, eval_s=5.0), arm_wall_s=50.0)
    assert sync["loop_wall_s"] == pytest.approx(12.0)  # 4 x 3 s; the mid-run eval is not counted
    assert sync["steps_per_hour"] == pytest.approx(4 / 12 * 3600)
    assert (sync["acc_initial"], sync["acc_final"]) == (0.5, 0.6)
    assert sync["flip_frac_mean"] == pytest.approx(0.02) and math.isnan(sync["kl_stale_mean"])
    write_table([sync, fast], tmp_path)
    assert fast["speedup_vs_sync"] == pytest.approx(1.5)  # 2 s vs 3 s per step
    assert sync["speedup_vs_sync"] == 1.0
    table = (tmp_path / "compare.md").read_text()
    assert "| async1-int8-acr-uaq | 4 | 0.5 | 0.6 | 1800 | 1.5 |" in table


@pytest.mark.slow
def test_two_arm_compare_runs_real_processes(tmp_path):
    """`compare` with two arms: each runs as its own `qurl train` process to the end, the table
    has a row per arm with a measured (finite, positive) speed and the plots are written."""
    cfg = tiny_cfg(tmp_path, "unused", 2, **{"run.torch_threads": 1})
    path = compare(cfg, tmp_path / "cmp", arms=["sync-int8-acr-uaq", "async1-int8-acr-uaq"])
    text = path.read_text()
    for arm in ("sync-int8-acr-uaq", "async1-int8-acr-uaq"):
        recs = read_metrics(tmp_path / "cmp" / arm / "metrics.jsonl")
        assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2]
        assert f"| {arm} | 2 |" in text
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| async1")]
    assert float(rows[0][5]) > 0 and math.isfinite(float(rows[0][6]))  # steps/h, speedup
    assert (tmp_path / "cmp" / "compare_step.png").stat().st_size > 0
    assert (tmp_path / "cmp" / "compare_wall.png").stat().st_size > 0
