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
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import cli_sets, tiny_sets

from qurl.train.metrics_log import read_metrics

REPO = Path(__file__).resolve().parent.parent
NODES = ("10.77.0.1", "10.77.0.2")
pytestmark = pytest.mark.slow  # two tiny training runs across the namespaces


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def namespaces():
    """Two namespaces (names returned, node 0 first) joined by a veth pair; removed afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (`ip netns`) to make two network namespaces")
    if os.geteuid() != 0:
        pytest.skip("needs root: creating network namespaces (ip netns add) is privileged")
    tag = f"q{os.getpid() % 100000}"
    names, links = [f"{tag}n0", f"{tag}n1"], [f"{tag}v0", f"{tag}v1"]
    steps = [("netns", "add", names[0]), ("netns", "add", names[1]),
             ("link", "add", links[0], "type", "veth", "peer", "name", links[1])]
    for ns, link, addr in zip(names, links, NODES):
        steps += [("link", "set", link, "netns", ns), ("-n", ns, "addr", "add", f"{addr}/24",
                                                         "dev", link),
                  ("-n", ns, "link", "set", link, "up"), ("-n", ns, "link", "set", "lo", "up")]
    try:
        for s in steps:
            done = _ip(*s)
            if done.returncode:
                pytest.skip(f"cannot make the namespaces here: ip {' '.join(s)}: "
                            f"{done.stderr.strip()}")
        yield names
    finally:
        for ns in names:
            _ip("netns", "del", ns)


def _launch_both(names: list[str], sets: dict, tmp: Path, timeout_s: float = 540) -> list[str]:
    """`qurl launch --node-rank k` in namespace k, both at once; returns their outputs."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for k in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(k, None)
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
    """One learner rank per node (learner.tp=2, deploy.nnodes=2): the TP all-reduces and the
    control broadcasts cross the veth pair; both ranks train 2 steps."""
    root = runs_dir("twonode-tp2")
    sets = tiny_sets(root, "tp2", 2, **{"learner.tp": 2, "deploy.nnodes": 2,
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
