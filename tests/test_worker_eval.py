"""The async actor is evaluated on the rollout workers (issue 59 item 7, remote_eval.py).

An async run (deploy.rollout=workers) evaluating every step must build no local decoder of the
8-bit actor in the controller's process (on a GPU that decoder sat on the learner's device), and
its evaluation must score what a local engine scores on the same version's weights at the same
precision: `qurl eval` of the run's last checkpoint quantizes the checkpoint's master weights
again, loads them into a fresh local engine and asks the same requests (same seeds), so every
`eval/...` metric (greedy and sampled Avg@k / pass@k) agrees exactly.
"""
from __future__ import annotations

import re

import pytest
from pipeline_helpers import tiny_cfg, trained_uids, use_free_dist_port

from qurl.train.metrics_log import read_metrics


@pytest.fixture(scope="module")
def run_root(runs_dir):
    use_free_dist_port()
    return runs_dir("worker_eval")


@pytest.mark.slow
def test_async_actor_is_scored_by_the_workers_as_a_local_engine_would(run_root, monkeypatch):
    from qurl.engines import local
    from qurl.commands.eval import eval_run
    from qurl.commands.train import train

    built: list[str] = []  # precisions of the LocalEngines built in this (the controller's) process
    init = local.LocalEngine.__init__

    def counting(self, *args, **kw):
        built.append(kw.get("precision", "bf16"))
        init(self, *args, **kw)

    monkeypatch.setattr(local.LocalEngine, "__init__", counting)
    cfg = tiny_cfg(run_root, "weval", 1, **{
        "deploy.rollout": "workers", "run.eval_every": 1, "data.eval_size": 8,
        "eval.samples": 4, "eval.pass_k": 4, "eval.temperature": 1.0, "rollout.precision": "int8",
        "eval.fp_policy": False})
    final = train(cfg)
    assert built == [], built  # no local decoder of the 8-bit actor in the controller's process
    evals = [r for r in read_metrics(run_root / "weval" / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1]
    assert all("eval/mean/greedy" in r and "eval/mean/avg@4" in r for r in evals)
    # step 0's evaluation went to the workers: 8 greedy + 8 x 4 sampled requests, none trained
    train = [r for r in read_metrics(run_root / "weval" / "metrics.jsonl") if r["kind"] == "train"]
    assert train[0]["async/eval_requests"] == 8 + 8 * 4
    assert not any(re.fullmatch(r"e\d+\.\d+", u) for u in trained_uids(run_root / "weval"))
    monkeypatch.setattr(local.LocalEngine, "__init__", init)
    ref = eval_run(run_root / "weval")  # a local int8 engine on the last checkpoint's weights
    assert ref["version"] == final["version"] == 1
    keys = sorted(k for k in ref if k.startswith("eval/"))
    assert keys and keys == sorted(k for k in final if k.startswith("eval/"))
    assert {k: final[k] for k in keys} == {k: ref[k] for k in keys}
    # not vacuous: the briefly warm-started model gets a sampled answer right (Avg@4 1/32)
    assert final["eval/mean/avg@4"] > 0
