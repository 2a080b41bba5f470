"""Learner ranks waiting for rank 0 (its rollout, its evaluation) wait in the gloo control group
under deploy.ranks.wait_timeout_min, not under the default group's collective timeout (NCCL's watchdog
on GPU). Real torch.distributed gloo, two spawned ranks."""
from __future__ import annotations

import os
import time

import pytest
from spawn_in_turn import meet

from qurl.config import LearnerConfig, RanksDeployConfig
from qurl.learner.dist import spawn

GROUP_MIN = 0.03  # the default group's collective timeout in these tests: 1.8 s


def _wait_for_slow_rank0(rank: int, world: int, wait_min: float, sleep_s: float,
                         rank0_sends: bool) -> tuple[str, float]:
    """Rank 0 is busy `sleep_s` (generating), then broadcasts a batch (if rank0_sends); rank 1
    waits for it. Returns (what this rank got or the error it met, seconds it waited)."""
    import torch
    import torch.distributed as dist

    from qurl.learner.dist import broadcast_object, destroy_learner_dist, init_learner_dist

    init_learner_dist(LearnerConfig(tp=2), rank, world,
                      ranks=RanksDeployConfig(wait_timeout_min=wait_min), timeout_min=GROUP_MIN)
    t0 = time.monotonic()
    try:
        if rank == 0:
            time.sleep(sleep_s)
            if not rank0_sends:
                return "", 0.0
        got = broadcast_object({"batch": 7} if rank == 0 else None)
        t = torch.ones(1)
        dist.all_reduce(t)  # the default group still serves once both ranks are there
        return f"{got['batch']}:{int(t.item())}", time.monotonic() - t0
    except RuntimeError as e:
        return f"error: {e}", time.monotonic() - t0
    finally:
        destroy_learner_dist()


def _both_waits(rank: int, world: int, where: str) -> dict[str, tuple[str, float]]:
    """The two scenarios below in one pair of processes (each starts torch and megatron once):
    each joins a process group of its own at a port of its own, picked when the ranks meet
    (tests/spawn_in_turn.py: rank 1 must not reach the group's store more than the group's
    1.8 s timeout ahead of rank 0), and leaves it before the next one."""
    out = {}
    for name, wait_min, sleep_s, rank0_sends in SCENARIOS:
        os.environ["MASTER_PORT"] = str(meet(where, name, rank, world))
        out[name] = _wait_for_slow_rank0(rank, world, wait_min, sleep_s, rank0_sends)
    return out


# the one that completes first: the second leaves its control group timed out
SCENARIOS = [("outwait", 1.0, 4.0, True), ("timeout", 0.05, 8.0, False)]


@pytest.fixture(scope="module")
def waits(tmp_path_factory) -> list[dict[str, tuple[str, float]]]:
    return spawn(_both_waits, 2, str(tmp_path_factory.mktemp("meet")))


def test_followers_outwait_the_group_timeout_for_rank0(waits):
    # rank 0 busy 4 s, twice the default group's collective timeout; the wait allows 1 minute
    (r0, _), (r1, waited) = waits[0]["outwait"], waits[1]["outwait"]
    assert (r0, r1) == ("7:2", "7:2") and waited >= 3.5


def test_the_wait_ends_at_the_configured_timeout_naming_the_field(waits):
    # deploy.ranks.wait_timeout_min=0.05 (3 s), rank 0 busy 8 s: rank 1 stops waiting at ~3 s
    r1, waited = waits[1]["timeout"]
    assert r1.startswith("error: learner rank 1: waited deploy.ranks.wait_timeout_min=0.05 minutes"), r1
    assert 2.5 <= waited < 7.5


def test_a_rank_picks_the_interface_that_reaches_its_master(monkeypatch):
    """A torchrun started by hand (no `qurl launch`) gets GLOO/NCCL_SOCKET_IFNAME from the route to
    MASTER_ADDR; a value the user set wins; a loopback master changes nothing."""
    from qurl.learner.dist import pick_interface
    from qurl.node.netif import interface_addresses

    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # set first, so undo removes what
        monkeypatch.setenv(k, "")                          # pick_interface sets (a later test in
        monkeypatch.delenv(k)                              # this process must not inherit it)
    assert pick_interface("127.0.0.1") is None and "GLOO_SOCKET_IFNAME" not in os.environ
    outer = {n: a for n, a in interface_addresses().items() if not a.startswith("127.")}
    if not outer:
        pytest.skip("this machine has only loopback interfaces: nothing else to pick")
    name, addr = next(iter(outer.items()))
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice stays
    assert pick_interface(addr) == name
    assert os.environ["GLOO_SOCKET_IFNAME"] == name and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
