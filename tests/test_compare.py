"""`qurl compare`: arm configs, the table's numbers from hand-made records, and a real two-arm run.

The summary is checked against hand-worked values: steps/hour counts the training loop only, from
the end of the step-0 evaluation to the last train record, minus intermediate evaluations.
"""
from __future__ import annotations

import math

import pytest
from pipeline_helpers import tiny_cfg

from qurl.config import load_config
from qurl.research.studies import compare as compare_mod
from qurl.research.studies.compare import ARMS, arm_configs, compare, summarize, summarize_seeds, write_table
from qurl.train.metrics_log import read_metrics


def test_arm_configs_share_everything_but_the_arm(tmp_path):
    cfg = load_config(sets=["run.seed=7", "run.steps=5"])
    arms = arm_configs(cfg, tmp_path)
    assert list(arms) == [name for name, _ in ARMS]
    a, s = arms["async1-int8-acr-uaq"], arms["sync-int8-acr-uaq"]
    assert (a.deploy.rollout, a.rollout.max_staleness, s.deploy.rollout) == ("workers", 1, "inline")
    assert a.run.seed == s.run.seed == 7 and a.run.steps == s.run.steps == 5
    assert a.algo.uaq_scale == 1.5 and arms["sync-bf16"].algo.uaq_scale == 1.0
    assert arms["sync-int8-naive"].algo.loss == "naive"
    assert all(c.deploy.dir == str(tmp_path) and c.run.name == n for n, c in arms.items())
    two = arm_configs(cfg, tmp_path, ["async1-int8-acr-uaq", "sync-int8-acr-uaq"])
    assert list(two) == ["sync-int8-acr-uaq", "async1-int8-acr-uaq"]  # ARMS order
    with pytest.raises(ValueError, match="unknown"):
        arm_configs(cfg, tmp_path, ["sync-fp4"])


def _records(step_s: float, eval_s: float, threads: dict | None = None) -> list[dict]:
    """eval 0 ends at 10 s; 4 train steps of step_s each, an eval (eval_s) after step 2."""
    recs = [{"kind": "eval", "step": 0, "accuracy": 0.5, "wall": 10.0}]
    t = 10.0
    for step in range(1, 5):
        t += step_s
        recs.append({"kind": "train", "step": step, "reward": 0.1 * step, "kl_behav_prox": 1e-3,
                     "flip_frac": 0.02, "wall": t, **(threads or {"threads/learner": 2.0})})
        if step == 2:
            t += eval_s
            recs.append({"kind": "eval", "step": 2, "accuracy": 0.55, "time/eval": eval_s,
                         "wall": t})
    recs.append({"kind": "eval", "step": 4, "accuracy": 0.6, "wall": t + eval_s})
    return recs


def test_summary_counts_the_training_loop_only(tmp_path):
    sync = summarize("sync-int8-acr-uaq", _records(step_s=3.0, eval_s=5.0), arm_wall_s=60.0)
    fast = summarize("async1-int8-acr-uaq", _records(step_s=2.0, eval_s=5.0, threads={
        "threads/learner": 1.0, "threads/workers": 1.0}), arm_wall_s=50.0)
    assert sync["loop_wall_s"] == pytest.approx(12.0)  # 4 x 3 s; the mid-run eval is not counted
    assert sync["steps_per_hour"] == pytest.approx(4 / 12 * 3600)
    assert (sync["acc_initial"], sync["acc_final"]) == (0.5, 0.6)
    assert sync["flip_frac_mean"] == pytest.approx(0.02) and math.isnan(sync["kl_stale_mean"])
    write_table([sync, fast], tmp_path)
    assert fast["speedup_vs_sync"] == pytest.approx(1.5)  # 2 s vs 3 s per step
    assert sync["speedup_vs_sync"] == 1.0
    table = (tmp_path / "compare.md").read_text()
    assert (sync["threads"], fast["threads"]) == ("2", "1+1")  # learner(+workers) threads
    assert "| async1-int8-acr-uaq | 1+1 | 4 | 0.5 | 0.6 | 1800 | 1.5 |" in table


def _seed_rows(tmp_path, seed: int, sync_acc: float, async_acc: float, async_step_s: float) -> list:
    rows = [summarize("sync-int8-acr-uaq", _records(step_s=3.0, eval_s=5.0), arm_wall_s=60.0),
            summarize("async1-int8-acr-uaq", _records(step_s=async_step_s, eval_s=5.0), arm_wall_s=50.0)]
    rows[0]["acc_final"], rows[1]["acc_final"] = sync_acc, async_acc
    (tmp_path / f"seed{seed}").mkdir()
    write_table(rows, tmp_path / f"seed{seed}")
    return rows


def test_seed_summary_pairs_accuracy_by_seed(tmp_path):
    """Over two seeds (hand-worked): async - sync accuracy -0.04 and +0.02 -> mean -0.01, sd
    0.0424; speedups 1.5 and 1.2 -> mean 1.35, min 1.2, max 1.5; sync arms have no delta."""
    by_seed = {0: _seed_rows(tmp_path, 0, 0.60, 0.56, 2.0), 1: _seed_rows(tmp_path, 1, 0.40, 0.42, 2.5)}
    summary = {r["arm"]: r for r in summarize_seeds(by_seed)}
    a, s = summary["async1-int8-acr-uaq"], summary["sync-int8-acr-uaq"]
    assert a["seeds"] == 2 and a["acc_vs_sync_mean"] == pytest.approx(-0.01)
    assert a["acc_vs_sync_sd"] == pytest.approx(math.sqrt(2 * 0.03 ** 2))
    assert a["acc_final_mean"] == pytest.approx(0.49) and a["acc_final_sd"] == pytest.approx(0.14 / math.sqrt(2))
    assert (a["speedup_mean"], a["speedup_min"], a["speedup_max"]) == pytest.approx((1.35, 1.2, 1.5))
    assert a["steps_per_hour_mean"] == pytest.approx((1800 + 1440) / 2)
    assert math.isnan(s["acc_vs_sync_mean"]) and s["speedup_mean"] == 1.0
    path = compare_mod.write_seed_table(summarize_seeds(by_seed), by_seed, tmp_path)
    assert a["reward_last5_mean"] == pytest.approx(0.25) and a["reward_vs_sync_mean"] == pytest.approx(0)
    assert "| async1-int8-acr-uaq | 2 | 0.49 | 0.099 | -0.01 | 0.0424 | 0.25 | 0 | 1620 | 1.35 | 1.2 | 1.5 |" \
        in path.read_text()


def test_compare_over_seeds_runs_one_compare_per_seed(tmp_path, monkeypatch):
    """--seeds: each seed's compare runs with that run.seed into OUT/seed<S>/, then the summary."""
    calls = []

    def fake(cfg, out, arms):
        calls.append((cfg.run.seed, out.name, arms))
        return out / "compare.md", _seed_rows(tmp_path, cfg.run.seed, 0.5, 0.5, 2.0)

    monkeypatch.setattr(compare_mod, "_compare_seed", fake)
    path = compare(load_config(sets=["run.seed=9"]), tmp_path, arms=["sync-int8-acr-uaq"], seeds=[3, 1])
    assert calls == [(3, "seed3", ["sync-int8-acr-uaq"]), (1, "seed1", ["sync-int8-acr-uaq"])]
    assert path == tmp_path / "compare_seeds.md" and "Seeds 3, 1" in path.read_text()
    with pytest.raises(ValueError, match="each seed once"):
        compare(load_config(), tmp_path, seeds=[2, 2])


@pytest.mark.parametrize("seeds", ["1,1", "a,b", "", "-1"])
def test_cli_refuses_bad_seed_lists(seeds, capsys):
    from qurl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["compare", "--seeds", seeds])
    assert e.value.code == 2 and "--seeds" in capsys.readouterr().err


@pytest.mark.slow
def test_two_arm_compare_runs_real_processes(tmp_path, runs_dir):
    """`compare` with two arms: each runs as its own `qurl train` process to the end, the table
    has a row per arm with a measured (finite, positive) speed and the plots are written."""
    cfg = tiny_cfg(tmp_path, "unused", 2, **{"deploy.torch_threads": 1})
    out = runs_dir("cmp")  # the arms' deploy.dir: base model from the session's shared cache
    path = compare(cfg, out, arms=["sync-int8-acr-uaq", "async1-int8-acr-uaq"])
    text = path.read_text()
    for arm, threads in (("sync-int8-acr-uaq", "1"), ("async1-int8-acr-uaq", "1+1")):
        recs = read_metrics(out / arm / "metrics.jsonl")
        assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2]
        assert f"| {arm} | {threads} | 2 |" in text  # deploy.torch_threads=1: one per process
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| async1")]
    assert float(rows[0][6]) > 0 and math.isfinite(float(rows[0][7]))  # steps/h, speedup
    assert (out / "compare_step.png").stat().st_size > 0
    assert (out / "compare_wall.png").stat().st_size > 0
