"""StalenessController (AReaL's dispatch rule, values worked by hand) and TrajectoryBuffer
(grouping, stale drops, lossless state)."""
from __future__ import annotations

import io

import pytest
import torch

from qurl.pipeline.staleness import StalenessController, TrajectoryBuffer
from qurl.types import Trajectory


def traj(uid: str, idx: int, versions: list[int], reward: float = 1.0, seed: int = 0) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    n = len(versions)
    return Trajectory(prompt_uid=uid, sample_idx=idx,
                      prompt_ids=torch.randint(0, 50, (3,), generator=g),
                      response_ids=torch.randint(0, 50, (n,), generator=g),
                      behav_logp=-torch.rand(n, generator=g),
                      versions=torch.tensor(versions, dtype=torch.int64),
                      reward=reward, finish_reason="stop")


def dispatch_until_blocked(c: StalenessController, version: int) -> int:
    n = 0
    while c.can_dispatch(version):
        c.on_dispatch()
        n += 1
    return n


# ------------------------------------------------------------------ controller


def test_eta0_is_synchronous():
    c = StalenessController(batch_size=4, max_staleness=0)
    # (0 + 0 + 1)*4 - 0 = 4 > 0 ... (1)*4 - 4 = 0: exactly batch_size dispatches at version 0
    assert dispatch_until_blocked(c, 0) == 4
    c.on_accept(4)  # all four came back: accepted=4, running=0 -> still 4 - 4 = 0 at version 0
    assert not c.can_dispatch(0) and c.capacity(0) == 0
    assert c.capacity(1) == 4 and dispatch_until_blocked(c, 1) == 4  # after one train step


def test_eta1_allows_one_batch_ahead():
    c = StalenessController(batch_size=3, max_staleness=1)
    assert dispatch_until_blocked(c, 0) == 6  # (1 + 0 + 1)*3 = 6
    c.on_accept(2)
    c.on_reject(1)  # a failed rollout frees its slot: accepted=2, running=3 -> 6 - 5 = 1
    assert c.capacity(0) == 1 and dispatch_until_blocked(c, 0) == 1
    assert c.capacity(2) == (1 + 2 + 1) * 3 - (2 + 4)  # = 6


def test_controller_rejects_overfinish_and_roundtrips():
    c = StalenessController(2, 1)
    c.on_dispatch(2)
    with pytest.raises(ValueError, match="running"):
        c.on_accept(3)
    c.on_accept(1)
    d = StalenessController(2, 1)
    d.load_state_dict(c.state_dict())
    assert (d.accepted, d.running) == (1, 1) and d.capacity(0) == c.capacity(0) == 2
    with pytest.raises(ValueError, match="differ"):
        StalenessController(2, 0).load_state_dict(c.state_dict())


def test_controller_bound_holds_in_a_simulated_async_run():
    # Trainer consumes batch_size accepted units per step; data produced at version v is never
    # used later than step v + eta (the reason for the rule).
    batch, eta = 4, 2
    c = StalenessController(batch, eta)
    version, in_flight, ready = 0, [], []
    for tick in range(200):
        while c.can_dispatch(version):
            c.on_dispatch()
            in_flight.append(version)
        if in_flight and tick % 2 == 0:  # one unit finishes every other tick
            ready.append(in_flight.pop(0))
            c.on_accept(1)
        if len(ready) >= batch:
            used, ready = ready[:batch], ready[batch:]
            assert all(version - v <= eta for v in used)
            version += 1
        assert c.accepted + c.running <= (eta + version + 1) * batch
    assert version > 10


# ------------------------------------------------------------------ buffer


def test_groups_complete_fifo_by_completion():
    b = TrajectoryBuffer(group_size=2, max_staleness=1)
    assert b.put(traj("a", 0, [0]), 0) == "kept"
    assert b.put(traj("b", 1, [0]), 0) == "kept"
    assert b.put(traj("b", 0, [0]), 0) == "complete"
    assert b.pop_batch(2) is None  # only "b" complete
    assert b.put(traj("a", 1, [0, 0]), 0) == "complete"
    groups = b.pop_batch(2)
    assert [[t.prompt_uid for t in g] for g in groups] == [["b", "b"], ["a", "a"]]
    assert [[t.sample_idx for t in g] for g in groups] == [[0, 1], [0, 1]]  # sorted within group
    assert len(b) == 0 and b.stats["groups_popped"] == 2


def test_stale_trajectory_drops_its_group_and_later_siblings():
    b = TrajectoryBuffer(group_size=3, max_staleness=1)
    assert b.put(traj("g", 0, [3, 3]), 3) == "kept"
    # oldest token v1 < current 3 - eta 1 = 2 -> stale, even though later tokens are fresh
    assert b.put(traj("g", 1, [1, 2, 3]), 3) == "stale"
    assert b.pending_uids() == [] and b.stats["groups_dropped"] == 1
    assert b.stats["dropped_with_group"] == 1 and b.stats["stale"] == 1
    assert b.put(traj("g", 2, [3]), 3) == "dropped_group"  # its sibling is not resurrected
    assert "g" not in b._dropped  # all three samples accounted for: the uid is forgotten
    # boundary: oldest version exactly current - eta is fresh
    assert b.put(traj("h", 0, [2, 3]), 3) == "kept"


def test_duplicates_and_bad_sample_idx():
    b = TrajectoryBuffer(group_size=2, max_staleness=0)
    assert b.put(traj("a", 0, [0], reward=1.0), 0) == "kept"
    assert b.put(traj("a", 0, [0], reward=0.0), 0) == "duplicate"  # first copy wins
    assert b.put(traj("a", 2, [0]), 0) == "bad_sample_idx"
    assert b.put(traj("a", 1, [0]), 0) == "complete"
    assert [t.reward for t in b.pop_batch(1)[0]] == [1.0, 1.0]
    assert b.stats["duplicate"] == 1 and b.stats["bad_sample_idx"] == 1


def test_evict_stale_at_pop_time():
    b = TrajectoryBuffer(group_size=1, max_staleness=1)
    for uid, v in (("old", 0), ("new", 1)):
        b.put(traj(uid, 0, [v]), 1)
    assert b.num_complete == 2
    groups = b.pop_batch(1, current_version=2)  # v0 is now 2 versions old: evicted first
    assert [g[0].prompt_uid for g in groups] == ["new"]
    assert b.stats["stale"] == 1 and b.stats["groups_dropped"] == 1
    assert b.stats["dropped_with_group"] == 0


def test_state_dict_is_lossless_through_torch_save():
    b = TrajectoryBuffer(group_size=2, max_staleness=1)
    big = torch.arange(10_000, dtype=torch.int64)  # trajectories are views into a large buffer
    t0 = traj("a", 0, [1, 1, 2], seed=1)
    t0.response_ids = big[5:8]
    b.put(t0, 2)
    b.put(traj("b", 0, [2], seed=2, reward=-0.25), 2)
    b.put(traj("b", 1, [2, 2], seed=3), 2)
    b.put(traj("c", 0, [0], seed=4), 2)  # stale -> "c" remembered as dropped
    state = b.state_dict()
    assert state["groups"][0][1][0]["response_ids"].untyped_storage().nbytes() == 3 * 8  # owned copy
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    c = TrajectoryBuffer(group_size=2, max_staleness=1)
    c.load_state_dict(torch.load(blob, weights_only=True))
    assert c.pending_uids() == ["a", "b"] and c.num_complete == 1 and c.stats == b.stats
    assert c.put(traj("c", 1, [2]), 2) == "dropped_group"
    for x, y in zip(b.pop_batch(1)[0], c.pop_batch(1)[0]):
        assert (x.prompt_uid, x.sample_idx, x.reward, x.finish_reason) == \
               (y.prompt_uid, y.sample_idx, y.reward, y.finish_reason)
        for f in ("prompt_ids", "response_ids", "behav_logp", "versions"):
            assert torch.equal(getattr(x, f), getattr(y, f)) and getattr(x, f).dtype == getattr(y, f).dtype
    assert c.put(traj("a", 1, [2]), 2) == "complete"
    assert torch.equal(c.pop_batch(1)[0][0].response_ids, torch.tensor([5, 6, 7]))
    with pytest.raises(ValueError, match="differ"):
        TrajectoryBuffer(group_size=3, max_staleness=1).load_state_dict(state)
