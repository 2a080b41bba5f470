"""The engine's routed experts travel with the trajectory (issue 67 item 4, trajectory half):
GenResult -> Trajectory, the stream's schema (packed, validated, unpacked), buffered trajectories
in a checkpoint, and the learner's padded batch. Dense trajectories (routed_experts None) travel
as before, in the same message layout. Pure tensors, no sockets, no learner.
"""
from __future__ import annotations

import pytest
import torch

from qurl.pipeline.frames import WireError
from qurl.pipeline.payload import pack_trajectories, unpack_trajectories, validate_packed
from qurl.types import GenResult, Trajectory

L_MOE, K, E = 2, 2, 8
MOE = (L_MOE, K, E)


def _traj(uid: str, idx: int, P: int, T: int, routes: bool = True, seed: int = 0) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(E, generator=g)[:K] for _ in range((P + T - 1) * L_MOE)]
    r = torch.stack(rows) if rows else torch.zeros(0, K, dtype=torch.int64)
    return Trajectory(prompt_uid=uid, sample_idx=idx, prompt_ids=torch.arange(1, P + 1),
                      response_ids=torch.arange(10, 10 + T), behav_logp=-torch.rand(T, generator=g),
                      versions=torch.zeros(T, dtype=torch.int64), reward=1.0, finish_reason="stop",
                      routed_experts=r.reshape(P + T - 1, L_MOE, K).to(torch.uint8) if routes else None)


def _check(meta, tensors, moe=MOE) -> None:
    validate_packed(meta, tensors, vocab_size=100, current_version=0, max_len=64, moe=moe)


def test_generate_copies_the_routes() -> None:
    from qurl.train.generate import unscored

    r = torch.zeros(3 + 4 - 1, L_MOE, K, dtype=torch.uint8)
    res = GenResult(rid="p#0", prompt_ids=[1, 2, 3], output_ids=torch.arange(4),
                    logprobs=torch.zeros(4), versions=torch.zeros(4, dtype=torch.int64),
                    finish_reason="stop", routed_experts=r)
    assert unscored([res])[0].routed_experts is r
    assert unscored([GenResult("p#1", [1], torch.arange(2), torch.zeros(2),
                               torch.zeros(2, dtype=torch.int64), "stop")])[0].routed_experts is None


def test_routes_round_trip_through_the_schema() -> None:
    trajs = [_traj("a", 0, 3, 4, seed=1), _traj("a", 1, 3, 1, seed=2), _traj("b", 0, 1, 0, seed=3)]
    meta, tensors = pack_trajectories(trajs)
    assert tensors["routed_experts"].shape == (6 + 3 + 0, L_MOE, K)
    assert tensors["routed_experts"].dtype == torch.uint8
    _check(meta, tensors)
    back = unpack_trajectories(meta, tensors)
    assert [torch.equal(b.routed_experts, t.routed_experts) for b, t in zip(back, trajs)] == [True] * 3


def test_dense_messages_are_unchanged_and_still_accepted() -> None:
    trajs = [_traj("a", 0, 3, 4, routes=False), _traj("a", 1, 2, 2, routes=False)]
    meta, tensors = pack_trajectories(trajs)
    assert "routed_experts" not in tensors  # the pre-MoE layout, byte for byte
    _check(meta, tensors, moe=None)
    _check(meta, tensors)  # a MoE receiver takes trajectories without routes (replay off)
    assert all(t.routed_experts is None for t in unpack_trajectories(meta, tensors))


@pytest.mark.parametrize("edit,reason", [
    (lambda t: t.__setitem__("routed_experts", t["routed_experts"][1:]), "bad_tensor"),
    (lambda t: t.__setitem__("routed_experts", t["routed_experts"].float()), "bad_tensor"),
    (lambda t: t.__setitem__("routed_experts", t["routed_experts"].to(torch.int32)), "invalid"),
    (lambda t: t.__setitem__("routed_experts", t["routed_experts"][:, :1]), "invalid"),
    (lambda t: t["routed_experts"][7, 1].fill_(E), "invalid"),
])
def test_bad_routes_are_refused(edit, reason: str) -> None:
    meta, tensors = pack_trajectories([_traj("a", 0, 3, 4), _traj("b", 0, 2, 3, seed=4)])
    tensors = dict(tensors, routed_experts=tensors["routed_experts"].clone())
    edit(tensors)
    with pytest.raises(WireError) as err:
        _check(meta, tensors)
    assert err.value.reason == reason
    if "expert id" in str(err.value):  # row 7 is trajectory 1's second row (trajectory 0 has 6)
        assert "'b'" in str(err.value)


def test_routes_to_a_dense_receiver_and_mixed_messages_are_refused() -> None:
    meta, tensors = pack_trajectories([_traj("a", 0, 3, 4)])
    with pytest.raises(WireError, match="dense"):
        _check(meta, tensors, moe=None)
    with pytest.raises(ValueError, match="with and without"):
        pack_trajectories([_traj("a", 0, 3, 4), _traj("a", 1, 3, 4, routes=False)])
    with pytest.raises(ValueError, match="P \\+ T - 1"):
        t = _traj("a", 0, 3, 4)
        t.routed_experts = t.routed_experts[:-1]
        pack_trajectories([t])


def test_buffered_routes_survive_a_checkpoint_and_old_checkpoints_load() -> None:
    from qurl.pipeline.staleness import TrajectoryBuffer

    buf = TrajectoryBuffer(group_size=2, max_staleness=1)
    t = _traj("a", 0, 3, 4)
    buf.put(t, 0)
    state = buf.state_dict()
    again = TrajectoryBuffer(group_size=2, max_staleness=1)
    again.load_state_dict(state)
    got = again.group("a")[0].routed_experts
    assert torch.equal(got, t.routed_experts) and got.data_ptr() != t.routed_experts.data_ptr()
    for d in state["groups"][0][1]:  # a checkpoint written before routed_experts existed
        d.pop("routed_experts")
    old = TrajectoryBuffer(group_size=2, max_staleness=1)
    old.load_state_dict(state)
    assert old.group("a")[0].routed_experts is None


def test_batch_aligns_routes_with_tokens_and_fills_the_rest() -> None:
    from qurl.train.batch import build_batch

    a, b = _traj("a", 0, 3, 4, seed=1), _traj("a", 1, 2, 2, seed=2)
    b.reward = 0.0
    batch, _ = build_batch([[a, b]], version=0, pad_id=0)
    assert batch.routes.shape == (2, 7, L_MOE, K) and batch.routes.dtype == torch.uint8
    assert torch.equal(batch.routes[0, :6], a.routed_experts)
    assert torch.equal(batch.routes[1, :3], b.routed_experts)
    filler = torch.tensor([0, 1], dtype=torch.uint8).expand(L_MOE, K)
    for row, col in [(0, 6), (1, 3), (1, 4), (1, 5), (1, 6)]:  # last tokens and padding
        assert torch.equal(batch.routes[row, col], filler)
    b.routed_experts = None
    assert build_batch([[a, b]], version=0, pad_id=0)[0].routes is None


def test_route_shape_of_a_checkpoints_fields() -> None:
    from qurl.models.fits import read_fields
    from qurl.models.moe import route_shape

    assert route_shape(read_fields("tiny-qwen3-moe"))[1:] == (2, 8)  # (L, k, E): top-2 of 8
    assert route_shape(read_fields("tiny")) is None


def test_routes_cross_a_real_socket_and_bad_ones_are_counted() -> None:
    """Over ZeroMQ with the channel's HMAC and validation: bit-exact routes arrive; a message
    with an expert id >= E is rejected and counted, not delivered."""
    import secrets

    from qurl.pipeline.channel import Receiver, Sender

    key = secrets.token_bytes(32)
    recv = Receiver("tcp://127.0.0.1:0", key, kinds=("trajectory",), vocab_size=100, max_len=64,
                    moe=MOE)
    send = Sender(recv.endpoint, key, name="w0", linger_ms=0)
    try:
        trajs = [_traj("a", 0, 3, 4, seed=1), _traj("a", 1, 2, 5, seed=2)]
        assert send.send("trajectory", *pack_trajectories(trajs))
        msg = recv.recv(5000)
        assert msg is not None
        assert all(torch.equal(a.routed_experts, b.routed_experts)
                   for a, b in zip(trajs, msg.payload))
        bad = _traj("b", 0, 3, 4)
        bad.routed_experts[2, 0, 1] = E
        assert send.send("trajectory", *pack_trajectories([bad]))
        assert recv.recv(500) is None and recv.rejects == {"invalid": 1}
    finally:
        send.close()
        recv.close()
