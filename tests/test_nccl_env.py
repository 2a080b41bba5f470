"""One NCCL environment per weight group (qurl/weights/nccl_env.py): members that differ are refused
at formation in one line naming both sides, over gloo here (the check runs on the group's store,
whatever the backend); members that agree form the group; SGLang peers, which cannot report, are
checked from the settings they were launched with, before any invitation."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qurl.weights.broadcaster import Broadcaster
from qurl.weights.group import WeightGroup, free_port
from qurl.weights.nccl_env import QURL_NCCL, NcclMismatch, settings, with_nccl_defaults

ROOT = Path(__file__).resolve().parents[1]

PEER = """
import sys, torch
from qurl.weights.group import WeightGroup
try:
    g = WeightGroup("127.0.0.1", int(sys.argv[1]), 1, 2, "gloo", "g", timeout_s=60)
except Exception as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(3)
t = torch.zeros(3)
g.broadcast(t)
print(t.tolist())
"""


def _peer(port: int, nccl: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env.update(nccl, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", PEER, str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def qurl_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("NCCL_"):
            monkeypatch.delenv(k)
    for k, v in QURL_NCCL.items():
        monkeypatch.setenv(k, v)


def test_a_group_whose_members_differ_is_refused_in_one_line(qurl_env):
    """Rank 0 with qurl's NCCL_CUMEM_ENABLE=0, the peer with NCCL's default (unset): both refuse,
    with the same line. Before the check the group formed and the broadcast went through."""
    port = free_port()
    peer = _peer(port, {"NCCL_NVLS_ENABLE": "0"})
    try:
        with pytest.raises(NcclMismatch) as refused:
            WeightGroup("127.0.0.1", port, 0, 2, "gloo", "g", timeout_s=60)
        out, _ = peer.communicate(timeout=60)
    finally:
        if peer.poll() is None:
            peer.kill()
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("NCCL settings differ inside one weight group: NCCL_CUMEM_ENABLE=0 "
                           "on rank 0 (") and ", NCCL_CUMEM_ENABLE=unset on rank 1 (" in line
    assert peer.returncode == 3 and out.strip() == f"NcclMismatch: {line}"


def test_members_that_agree_form_the_group(qurl_env):
    port = free_port()
    peer = _peer(port, dict(QURL_NCCL))
    try:
        group = WeightGroup("127.0.0.1", port, 0, 2, "gloo", "g", timeout_s=60)
        group.broadcast(torch.tensor([1.0, 2.0, 3.0]))
        out, _ = peer.communicate(timeout=60)
        group.close()
    finally:
        if peer.poll() is None:
            peer.kill()
    assert peer.returncode == 0 and out.strip() == "[1.0, 2.0, 3.0]"


def test_launched_peers_are_checked_before_any_invitation(qurl_env):
    invited = []
    b = Broadcaster("127.0.0.1", 0, "gloo", name="w", bucket_bytes=1 << 20, timeout_s=5)
    server = settings(dict(with_nccl_defaults({}), NCCL_NVLS_ENABLE="1"))
    with pytest.raises(NcclMismatch, match=r"NCCL_NVLS_ENABLE=0 on rank 0 \(.*\), "
                                           r"NCCL_NVLS_ENABLE=1 on sglang http://h:1 rank 0; "):
        b.form(2, lambda spec: invited.append(spec), known={"sglang http://h:1 rank 0": server})
    assert invited == []


def test_defaults_keep_what_the_environment_sets():
    assert with_nccl_defaults({}) == QURL_NCCL
    assert with_nccl_defaults({"NCCL_CUMEM_ENABLE": "1"})["NCCL_CUMEM_ENABLE"] == "1"
    assert settings({})["NCCL_CUMEM_ENABLE"] == "unset"
