"""Deploying SGLang engines the way a first multi-GPU run needs (issue 20): servers qurl launches
get GPUs of their own, the weight group's backend is a config choice, an attached server's TP
size is checked, and a refused update fails in seconds, not after the group timeout.

The servers here are tests/fake_sglang.py (real HTTP, real gloo weight group, the 0.5.23 schema);
tests/test_sglang_real.py repeats the refused update on the real server.
"""
from __future__ import annotations

import subprocess
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from test_sglang_engine import (FAST, _fake_cmd, _model_dir, _named, _post, _same, _wait_healthy,
                                engine_of)

from qurl.config import ConfigError, load_config
from qurl.engines.sglang.engine import SGLangEngine, Timeouts
from qurl.engines.sglang.launcher import ServerSpec, server_command
from qurl.engines.sglang.protocol import SGLangError
from qurl.node import placement
from qurl.weights.group import free_port


# ------------------------------------------------------------------------------ GPU placement
def test_sglang_servers_take_gpus_after_the_learner():
    """The learner's ranks on a node hold GPUs 0..P-1; each launched server takes sglang.tp
    GPUs after them, in order; a node with too few GPUs is a one-line error (servers never
    share a GPU: their memory pool and their NCCL ranks need one each); no GPUs, no placement."""
    def sglang_base_gpus(cfg, count, n_gpus, **kw):
        return placement.sglang_base_gpus(cfg.learner, cfg.deploy.ranks, cfg.sglang, count, n_gpus,
                                          **kw)

    cfg = load_config(sets=["learner.tp=2", "sglang.tp=2", "deploy.engines=3"])
    assert sglang_base_gpus(cfg, 3, 8) == [2, 4, 6]  # servers on GPUs 2-3, 4-5, 6-7
    assert sglang_base_gpus(cfg, 3, 8, slot=1) == [4]  # async worker 1's one server
    with pytest.raises(ConfigError, match=r"need GPUs 2\.\.7 after the learner's 2 .* has 7"):
        sglang_base_gpus(cfg, 3, 7)
    with pytest.raises(ConfigError, match="async worker 2"):
        sglang_base_gpus(cfg, 3, 5, slot=2)
    assert sglang_base_gpus(cfg, 3, 0) is None  # CPU
    one = load_config(sets=["sglang.tp=1"])
    assert sglang_base_gpus(one, 1, 2) == [1]  # one learner rank, one server: GPUs 0 and 1
    with pytest.raises(ConfigError):
        sglang_base_gpus(one, 1, 1)  # one GPU: the server would land on the learner's
    # two learner nodes of 4 ranks each (learner.tp=8): rank 0's node holds GPUs 0-3
    two = load_config(sets=["learner.tp=8", "deploy.ranks.nnodes=2", "sglang.tp=2", "deploy.engines=2"])
    assert sglang_base_gpus(two, 2, 8) == [4, 6]


def test_server_command_places_the_server_unless_the_user_did():
    cmd = server_command("/c", port=1, tp=2, base_gpu=4)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "4"
    assert "--base-gpu-id" not in server_command("/c", port=1)
    mine = server_command("/c", port=1, base_gpu=4, extra=("--base-gpu-id", "1"))
    assert mine.count("--base-gpu-id") == 1 and mine[mine.index("--base-gpu-id") + 1] == "1"


def test_make_engine_places_launched_servers(monkeypatch, tmp_path):
    """make_engine hands the placement to the adapter: on an 8-GPU node with 2 learner ranks,
    the sync loop's 2 servers of TP 2 start at GPUs 2 and 4, async worker 1's at GPU 4; attached
    servers (sglang.urls) are placed by whoever launched them."""
    seen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    from qurl.engines.sglang import from_config

    monkeypatch.setattr(from_config, "from_section",
                        lambda sg, md, **kw: seen.append(kw) or "engine")
    base = ["learner.tp=2", "sglang.tp=2", "deploy.engines=2", "rollout.engine=sglang",
            f"deploy.dir={tmp_path}"]
    assert engine_of(load_config(sets=base), "m") == "engine"
    engine_of(load_config(sets=base), "m", slot=1)
    engine_of(load_config(sets=base + ["sglang.urls=http://a:1,http://b:2"]), "m")
    assert [kw["base_gpus"] for kw in seen] == [[2, 4], [4], None]


# ----------------------------------------------------------------------- weight-group backend
def test_weight_group_backend_is_a_config_choice(tmp_path):
    """sglang.backend reaches the engine's weight group: gloo as asked; nccl on a machine
    without CUDA is refused at once with the field to change (before any server is contacted);
    auto is nccl with a GPU, else gloo."""
    assert load_config().sglang.backend == "auto"
    with pytest.raises(ConfigError, match="sglang.backend"):
        load_config(sets=["sglang.backend=mpi"])
    port = free_port()
    proc = subprocess.Popen(_fake_cmd(tmp_path, port, quantization="fp8"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
        sets = ["rollout.engine=sglang", "rollout.precision=fp8_block", f"sglang.urls={url}",
                f"deploy.dir={tmp_path}"]
        eng = engine_of(load_config(sets=sets + ["sglang.backend=gloo"]), str(_model_dir(tmp_path)))
        try:
            assert eng.weights.backend == "gloo" and eng.weights.formed
        finally:
            eng.close()
        if not torch.cuda.is_available():
            t0 = time.monotonic()
            with pytest.raises(ConfigError, match="sglang.backend=nccl: .*no CUDA device"):
                engine_of(load_config(sets=sets + ["sglang.backend=nccl"]),
                            str(_model_dir(tmp_path)))
            assert time.monotonic() - t0 < FAST.group_s  # refused, not a group that never forms
            auto = engine_of(load_config(sets=sets), str(_model_dir(tmp_path)))
            try:
                assert auto.weights.backend == "gloo"
            finally:
                auto.close()
        assert proc.poll() is None  # attached: never stopped by qurl
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------- attached server's TP size
def test_attached_server_with_another_tp_size_is_refused(tmp_path):
    """sglang.tp of an attached server is checked against its /server_info: a mismatch would
    size the weight group wrongly (ranks that never come: a wait until the group timeout)."""
    port = free_port()
    proc = subprocess.Popen(_fake_cmd(tmp_path, port), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
        t0 = time.monotonic()
        with pytest.raises(SGLangError, match=r"runs --tp-size 1 but qurl was told sglang.tp=2"):
            SGLangEngine([ServerSpec(url, tp=2)], precision="int8", timeouts=FAST)
        assert time.monotonic() - t0 < FAST.group_s
        eng = SGLangEngine([ServerSpec(url, tp=1)], precision="int8", timeouts=FAST)
        eng.close()
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------- a refused update
def test_refused_update_fails_in_seconds_and_the_engine_recovers(tmp_path):
    """A server that refuses a bucket (HTTP 400 at once, never joining its broadcast, as real
    SGLang refuses an update outside a session) used to leave the learner in the broadcast until
    the group timeout. Now the refusal is raised while the broadcast is in flight, the abandoned
    broadcast ends when recovery makes the server leave the group, and the next sync lands."""
    port = free_port()
    slow = Timeouts(control_s=20, generate_s=30, group_s=240, launch_s=90, health_s=5)
    eng = SGLangEngine([ServerSpec(f"http://127.0.0.1:{port}", command=_fake_cmd(tmp_path, port))],
                       precision="int8", bucket_bytes=4096, timeouts=slow, log_dir=tmp_path / "logs",
                       max_restarts=1)
    url = eng.servers[0].spec.url
    try:
        eng.load_weights(_named(1), 1)
        _post(url, "/_fake/fault", {"fault": "refuse_update"})
        t0 = time.monotonic()
        with pytest.raises(SGLangError, match="must run between begin_weight_update"):
            eng.load_weights(_named(2), 2)  # refused, recovered, refused again: raised
        took = time.monotonic() - t0
        print(f"refused update raised after {took:.1f}s (group timeout {slow.group_s:.0f}s)")
        assert took < slow.group_s / 4
        assert eng.version == 1
        deadline = time.monotonic() + 30  # the last abandoned broadcast ends with close() below
        _post(url, "/_fake/fault", {"fault": None})
        v3 = _named(3)
        eng.load_weights(v3, 3)  # a new group is formed and the update lands
        assert eng.version == 3
        assert _same(load_file(str(tmp_path / "dump" / f"port{port}_v3.safetensors")), v3)
        while time.monotonic() < deadline and any(
                t.name.startswith("release-") for t in threading.enumerate()):
            time.sleep(0.2)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("release-")]
    finally:
        eng.close()
