"""The MoE replay study's table (qurl/research/studies/moe_replay.py) from hand-made records:
per-run means over train records, first/last reward, the last evaluation; mean ± sd over seeds."""
from __future__ import annotations

import json

import pytest

from qurl.research.studies.moe_replay import arm_config, arm_name, run_summary, table


def _write(path, records):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(flip: float, kl: float) -> list[dict]:
    return [{"kind": "eval", "step": 0, "eval/mean/greedy": 0.1, "eval_fp/mean/greedy": 0.2},
            {"kind": "train", "step": 1, "reward": 0.25, "moe/route_flip_frac": flip,
             "moe/tokens_any_flip": 0.5, "kl_behav_prox": kl, "clip_frac_low": 0.01,
             "clip_frac_high": 0.03},
            {"kind": "train", "step": 2, "reward": 0.5, "moe/route_flip_frac": 3 * flip,
             "moe/tokens_any_flip": 0.7, "kl_behav_prox": 3 * kl},
            {"kind": "eval", "step": 2, "eval/mean/greedy": 0.3, "eval_fp/mean/greedy": 0.4}]


def test_a_runs_row_averages_its_steps_and_keeps_its_last_evaluation():
    row = run_summary(_run(0.1, 0.01))
    assert row["steps"] == 2 and row["flip"] == pytest.approx(0.2) and row["kl"] == pytest.approx(0.02)
    assert row["any_flip"] == pytest.approx(0.6) and row["clipped"] == pytest.approx(0.02)
    assert (row["reward_first"], row["reward_last"], row["acc"], row["acc_fp"]) == (0.25, 0.5, 0.3, 0.4)
    assert (row["reward_mean"], row["acc_first"]) == (0.375, 0.1)
    assert run_summary(_run(0.1, 0.01)[1:2])["acc"] is None  # no evaluation: no accuracy
    with pytest.raises(ValueError, match="no train records"):
        run_summary(_run(0.1, 0.01)[:1])


def test_the_table_gives_mean_and_sd_over_seeds_per_arm(tmp_path):
    _write(tmp_path / "int8-replay-off" / "seed0", _run(0.1, 0.01))
    _write(tmp_path / "int8-replay-off" / "seed1", _run(0.2, 0.03))
    _write(tmp_path / "int8-replay-rollout" / "seed0", _run(0.0, 0.001))
    md = table(tmp_path).splitlines()
    off = next(line for line in md if line.startswith("| int8-replay-off"))
    on = next(line for line in md if line.startswith("| int8-replay-rollout"))
    assert "| 0, 1 |" in off and "| 0.300 ± 0.141 |" in off  # flips 0.2 and 0.4 over the seeds
    assert "| 4.00e-02 ± 2.83e-02 |" in off  # KL 0.02 and 0.06
    assert "| 0 |" in on and "| 0.000 |" in on and "±" not in on  # one seed: no spread


def test_an_arm_is_its_precision_and_replay_under_its_seed(tmp_path):
    from qurl.config import Config

    cfg = arm_config(Config(), "fp8", "rollout", 2, tmp_path)
    assert (cfg.rollout.precision, cfg.algo.routing_replay, cfg.run.seed) == ("fp8", "rollout", 2)
    assert cfg.run.name == arm_name("fp8", "rollout") == "fp8-replay-rollout"
    assert cfg.deploy.dir == str(tmp_path / "seed2")
