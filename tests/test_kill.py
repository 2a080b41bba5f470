"""Kill tests of the async pipeline (real processes, SIGKILL, CPU, tiny model).

1. SIGKILL the controller (learner rank 0) mid-run after at least one checkpoint, resume with
   `qurl train --resume`: over the epoch every prompt id is trained exactly once, and the killed
   controller's workers do not outlive it.
2. SIGKILL a rollout worker mid-run: the controller replaces it, re-dispatches what it held, and
   every prompt is still trained exactly once.
3. With externally started workers, SIGKILL the controller: the worker survives, reconnects to the
   resumed controller, and every prompt is trained exactly once.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from pipeline_helpers import (assert_each_prompt_once, cli_sets, pid_alive, tiny_cfg, tiny_sets,
                              use_free_dist_port, worker_pids)

from qurl.train.metrics_log import read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ASYNC = {"deploy.rollout": "workers", "rollout.max_staleness": 1}


def _train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def _wait_for(cond, timeout_s: float, what: str, proc: subprocess.Popen | None = None,
              log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"process exited ({proc.returncode}) before {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _qurl(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env.pop("MASTER_PORT", None)  # the child picks its own free port
    with log.open("ab") as f:
        return subprocess.Popen([sys.executable, "-m", "qurl.cli", *args], stdout=f,
                                stderr=subprocess.STDOUT, env=env, cwd=str(REPO))


@pytest.fixture(scope="module")
def run_root(runs_dir):
    use_free_dist_port()
    return runs_dir("kill")


def test_sigkill_controller_then_resume_trains_each_prompt_once(run_root):
    # 6 steps x 4 prompts = one epoch of 24; killed after step 2, so 4 steps of margin
    extra = {**ASYNC, "data.train_size": 24}
    sets = tiny_sets(run_root, "ctl", 6, **extra)
    cfg = tiny_cfg(run_root, "ctl", 6, **extra)
    run_dir = run_root / "ctl"
    log = run_root / "ctl.log"
    proc = _qurl(["train", *cli_sets(sets)], log)
    try:
        _wait_for(lambda: len(_train_steps(run_dir)) >= 2 and (run_dir / "ckpt" / "latest").exists(),
                  600, "two trained steps and a checkpoint", proc, log)
        workers = worker_pids(run_dir)
        assert workers and all(pid_alive(p) for p in workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = max(_train_steps(run_dir))
    assert killed_at < 6, "the run finished before it could be killed"
    # the checkpoint resumed from holds work in progress: prompts in flight or groups buffered
    state = torch.load(run_dir / "ckpt" / (run_dir / "ckpt" / "latest").read_text().strip()
                       / "state.pt", weights_only=False)
    assert len(state["ledger"]["in_flight"]) + len(state["ledger"]["buffered"]) > 0
    # the orphaned workers notice their parent is gone and exit by themselves
    _wait_for(lambda: not any(pid_alive(p) for p in workers), 60, "orphaned workers to exit")

    resumed = _qurl(["train", "--resume", str(run_dir)], log)
    try:
        assert resumed.wait(600) == 0, log.read_text()[-3000:]
    finally:
        if resumed.poll() is None:
            resumed.kill()
    assert _train_steps(run_dir) == [1, 2, 3, 4, 5, 6]  # metrics truncated to the checkpoint
    assert_each_prompt_once(cfg, run_dir)
    assert not any(pid_alive(p) for p in worker_pids(run_dir))


def test_sigkill_worker_is_replaced_and_no_prompt_is_lost(run_root):
    from qurl.commands.train import train

    cfg = tiny_cfg(run_root, "wkr", 4, **ASYNC)
    run_dir = run_root / "wkr"
    killed: list[int] = []

    def killer() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if (run_dir / "metrics.jsonl").exists() and len(_train_steps(run_dir)) >= 1:
                pid = worker_pids(run_dir)[0]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    train(cfg)
    t.join(5)
    assert killed, "the worker was never killed"
    last = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"][-1]
    assert last["async/workers_replaced"] >= 1
    assert worker_pids(run_dir)[0] != killed[0]  # a new process took the slot
    assert_each_prompt_once(cfg, run_dir)


def test_external_worker_outlives_a_killed_controller_and_reconnects(run_root):
    """deploy.rollout=external: the worker is started by hand. SIGKILL the controller; the worker
    keeps running, finds the resumed controller in controller.json, reconnects, and the epoch is
    still trained exactly once."""
    extra = {**ASYNC, "deploy.rollout": "external", "data.train_size": 24}
    sets = tiny_sets(run_root, "ext", 6, **extra)
    cfg = tiny_cfg(run_root, "ext", 6, **extra)
    run_dir = run_root / "ext"
    log = run_root / "ext.log"
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env.pop("MASTER_PORT", None)
    proc = _qurl(["train", *cli_sets(sets)], log)
    with (run_root / "ext-worker.log").open("ab") as f:
        worker = subprocess.Popen([sys.executable, "-m", "qurl.pipeline.worker", "--run-dir",
                                   str(run_dir), "--slot", "0", "--reconnect-s", "2"],
                                  stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    resumed = None
    try:
        _wait_for(lambda: len(_train_steps(run_dir)) >= 2 and (run_dir / "ckpt" / "latest").exists(),
                  600, "two trained steps and a checkpoint", proc, log)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert max(_train_steps(run_dir)) < 6, "the run finished before it could be killed"
        assert worker.poll() is None  # an external worker does not die with its controller
        old_session = json.loads((run_dir / "controller.json").read_text())["session"]
        resumed = _qurl(["train", "--resume", str(run_dir)], log)
        assert resumed.wait(600) == 0, log.read_text()[-3000:]
        assert json.loads((run_dir / "controller.json").read_text())["session"] != old_session
        assert worker.wait(60) == 0  # the resumed controller told it to stop at the end
    finally:
        for p in (proc, resumed, worker):
            if p is not None and p.poll() is None:
                p.kill()
    assert_each_prompt_once(cfg, run_dir)
    text = (run_root / "ext-worker.log").read_text()
    assert "reconnecting" in text, text[-2000:]
