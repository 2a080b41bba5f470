"""Two nodes on one machine: two network namespaces joined by a veth pair (10.77.0.1 and
10.77.0.2), sharing the filesystem, each running its node's part of one `qurl launch` plan.

In a namespace the hostname resolves to loopback, so gloo left to itself advertises 127.0.0.1 and
a group spanning the two fails at `init_process_group` ("connectFullMesh failed ... remote=
[127.0.0.1]"); the plan sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface each node
reaches node 0 through (qurl/node/netif.py). Two runs: a TP = 2 learner with one rank per node under
torchrun, and an asynchronous learner (deploy.rollout=external) on node 0 whose local-engine worker
the plan puts on node 1. Creating namespaces needs root (and iproute2): skipped otherwise."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import cli_sets, tiny_sets

from qurl.research.bench import netns
from qurl.train.metrics_log import read_metrics

REPO = Path(__file__).resolve().parent.parent
NODES = ("10.77.0.1", "10.77.0.2")
pytestmark = pytest.mark.slow  # two tiny training runs across the namespaces


@pytest.fixture
def namespaces():
    """Two namespaces (names returned, node 0 first) joined by a veth pair; removed afterwards
    (qurl/research/bench/netns.py)."""
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    try:
        pair = netns.NodePair(NODES).__enter__()
    except RuntimeError as e:
        pytest.skip(f"cannot make the namespaces here: {e}")
    try:
        yield pair.names
    finally:
        pair.close()


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for k in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(k, None)
    return env


def _launch_both(names: list[str], sets: dict, tmp: Path, timeout_s: float = 540) -> list[str]:
    """`qurl launch --node-rank k` in namespace k, both at once; returns their outputs."""
    env = _env()
    procs = []
    for k, ns in enumerate(names):
        log = (tmp / f"node{k}.log").open("w")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "qurl", "launch", *cli_sets(sets),
             "--nodes", ",".join(NODES), "--gpus-per-node", "1", "--python", sys.executable,
             "--node-rank", str(k)], stdout=log, stderr=subprocess.STDOUT, env=env,
            cwd=str(REPO), start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    outs = [(tmp / f"node{k}.log").read_text() for k in range(2)]
    for k, p in enumerate(procs):
        assert p.returncode == 0, f"node {k} exited {p.returncode}:\n{outs[k][-3000:]}"
    return outs


def test_tp2_learner_across_two_namespaces(namespaces, runs_dir, tmp_path):
    """One learner rank per node (learner.tp=2, deploy.ranks.nnodes=2): the TP all-reduces and the
    control broadcasts cross the veth pair; both ranks train 2 steps."""
    root = runs_dir("twonode-tp2")
    sets = tiny_sets(root, "tp2", 2, **{"learner.tp": 2, "deploy.ranks.nnodes": 2,
                                         "deploy.ckpt_every": 0, "deploy.torch_threads": 1})
    _launch_both(namespaces, sets, tmp_path)
    recs = read_metrics(root / "tp2" / "metrics.jsonl")
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2]
    assert (root / "tp2" / "ckpt" / "step_000002").is_dir()


def test_async_learner_with_its_worker_on_the_other_namespace(namespaces, runs_dir, tmp_path):
    """deploy.rollout=external, local engine, one 'GPU' per node: the learner holds node 0's, so
    the plan puts the worker on node 1. It finds the controller through the shared run
    directory, joins its weight group across the veth pair, and the run trains 2 steps; the
    worker exits when the controller stops it, so node 1's launch returns too."""
    root = runs_dir("twonode-async")
    sets = tiny_sets(root, "async", 2, **{"deploy.rollout": "external", "rollout.max_staleness": 1,
                                           "deploy.ckpt_every": 0, "deploy.torch_threads": 1})
    outs = _launch_both(namespaces, sets, tmp_path)
    recs = read_metrics(root / "async" / "metrics.jsonl")
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2]
    assert len((root / "async" / "trained.jsonl").read_text().splitlines()) == 2
    assert "Traceback" not in outs[1], outs[1][-3000:]


def _controller_and_hand_worker(names: list[str], sets: dict, tmp: Path, run_dir: Path,
                                ctl_env: dict, timeout_s: float = 300) -> list[tuple[int, str]]:
    """`qurl train` on node 0 (no `qurl launch`: nothing sets GLOO_SOCKET_IFNAME) and a worker
    started by hand on node 1, as external mode allows; (exit status, output) of each."""
    procs = []
    cmds = [["-m", "qurl", "train", *cli_sets(sets)],
            ["-m", "qurl.pipeline.worker", "--run-dir", str(run_dir), "--slot", "0",
             "--host", NODES[1]]]
    for k, (ns, cmd) in enumerate(zip(names, cmds)):
        log = (tmp / f"hand{k}.log").open("w")
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *cmd],
                                      stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
                                      env={**_env(), **(ctl_env if k == 0 else {})},
                                      start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return [(p.returncode, (tmp / f"hand{k}.log").read_text()) for k, p in enumerate(procs)]


def test_hand_started_worker_on_the_other_node_joins_the_weight_group(namespaces, runs_dir,
                                                                       tmp_path):
    """Issue 59 item 8: controller on node 0 (deploy.host = its veth address), the worker started
    by hand on node 1 with --host. Both advertise, in the gloo weight group, the address they
    reach node 0 from (qurl/weights/group.py), not the hostname's loopback: the run trains 2 steps
    and the worker exits 0 when the controller stops it. (Before: "connectFullMesh failed ...
    remote 127.0.0.1", five 2-minute retries, and a worker that never exited.)"""
    root = runs_dir("twonode-hand")
    sets = tiny_sets(root, "hand", 2, **{"deploy.rollout": "external", "deploy.host": NODES[0],
                                         "rollout.max_staleness": 1, "deploy.ckpt_every": 0,
                                         "deploy.torch_threads": 1})
    (ctl_rc, ctl_out), (wk_rc, wk_out) = _controller_and_hand_worker(
        namespaces, sets, tmp_path, root / "hand", {})
    assert ctl_rc == 0, ctl_out[-3000:]
    assert wk_rc == 0, wk_out[-3000:]
    recs = read_metrics(root / "hand" / "metrics.jsonl")
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2]


def test_a_group_that_cannot_form_fails_at_once_in_one_line(namespaces, runs_dir, tmp_path):
    """The controller's gloo device forced onto loopback (GLOO_SOCKET_IFNAME=lo: what the
    hostname gave it before): the worker sees rank 0's loopback address, both stop at the first
    try with one line naming each rank's address (exit 2, no traceback), not after retries."""
    root = runs_dir("twonode-lo")
    sets = tiny_sets(root, "lo", 2, **{"deploy.rollout": "external", "deploy.host": NODES[0],
                                       "deploy.ckpt_every": 0, "deploy.torch_threads": 1})
    (ctl_rc, ctl_out), (wk_rc, wk_out) = _controller_and_hand_worker(
        namespaces, sets, tmp_path, root / "lo", {"GLOO_SOCKET_IFNAME": "lo"})
    assert ctl_rc == 2 and "Traceback" not in ctl_out, ctl_out[-3000:]
    line = [x for x in ctl_out.splitlines() if x.startswith("qurl: error")]
    assert len(line) == 1 and "0=lo" in line[0] and f"1={NODES[1]}" in line[0], ctl_out[-3000:]
    assert wk_rc == 2 and f"1={NODES[1]}" in wk_out, wk_out[-3000:]
