"""Stream wire format and ZeroMQ channel: real sockets on 127.0.0.1 with random ports.

Every hostile-input test sends the bad message over a real socket, checks it was counted under the
right reason, then sends a good message and checks it arrives (the receiver keeps working).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct

import pytest
import torch
import zmq
from blake3 import blake3

from qurl.pipeline.channel import Receiver, Sender
from qurl.pipeline.payload import (PromptTask, pack_prompt, pack_trajectories, unpack_trajectories,
                                 validate_packed, validate_trajectories)
from qurl.pipeline.frames import (CHUNK, DOMAIN, SCHEMA_VERSION, Limits, WireError, compute_mac, decode,
                              encode)
from qurl.types import SamplingParams, Trajectory

KEY = b"0123456789abcdef-run-key"
VOCAB = 1000
TIMEOUT_MS = 5000


def make_traj(uid: str, idx: int, p_len: int, t_len: int, version: int = 0, seed: int = 0,
              reward: float = 0.5) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    return Trajectory(
        prompt_uid=uid, sample_idx=idx,
        prompt_ids=torch.randint(0, VOCAB, (p_len,), generator=g),
        response_ids=torch.randint(0, VOCAB, (t_len,), generator=g),
        behav_logp=-torch.rand(t_len, generator=g) * 5,
        versions=torch.full((t_len,), version, dtype=torch.int64),
        reward=reward, finish_reason="stop" if t_len % 2 else "length",
        reward_timed_out=bool(idx % 2),
        behav_entropy=torch.rand(t_len, generator=g) * 3 if idx % 2 else None)


def batch(n: int = 5, version: int = 0, seed: int = 0) -> list[Trajectory]:
    return [make_traj(f"p{i // 2}", i % 2, 3 + i, 4 + 3 * i, version, seed + i, reward=i / 3 - 1)
            for i in range(n)]


def assert_traj_equal(a: Trajectory, b: Trajectory) -> None:
    assert (a.prompt_uid, a.sample_idx, a.finish_reason, a.reward_timed_out) == \
           (b.prompt_uid, b.sample_idx, b.finish_reason, b.reward_timed_out)
    assert a.reward == b.reward  # float64 on the wire: exact
    for f in ("prompt_ids", "response_ids", "behav_logp", "versions"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.numel() else x, y.view(torch.uint8) if y.numel() else y)
    # the engine's entropy: bit-exact where reported, None (never zeros) where not
    assert (a.behav_entropy is None) == (b.behav_entropy is None) or not a.response_ids.numel()
    if a.behav_entropy is not None and a.response_ids.numel():
        assert torch.equal(a.behav_entropy.view(torch.int32), b.behav_entropy.view(torch.int32))


@pytest.fixture(params=[1, 2], ids=["inline-mac", "pooled-mac"])
def link(request):
    """A bound trajectory Receiver, a connected Sender, and a raw PUSH for hand-made frames.
    hash_threads=2 checks payloads while the MAC is computed: verdicts must not change."""
    recv = Receiver("tcp://127.0.0.1:0", KEY, kinds=("trajectory", "control"), vocab_size=VOCAB,
                    max_len=64, current_version=3, hash_threads=request.param,
                    limits=Limits(max_frames=16, max_header_bytes=4096, max_message_bytes=1 << 16,
                                  max_tensor_elems=4096))
    send = Sender(recv.endpoint, KEY, name="w0", linger_ms=0)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(recv.endpoint)
    yield recv, send, raw
    raw.close()
    ctx.term()
    send.close()
    recv.close()


def forge(header: dict, raws: list[bytes], key: bytes = KEY) -> list[bytes]:
    head = json.dumps(header).encode()
    return [head, *raws, compute_mac([memoryview(head), *map(memoryview, raws)], key)]


def good_header(**over) -> dict:
    h = {"schema": SCHEMA_VERSION, "kind": "control", "seq": 0, "sender": "mallory", "meta": {},
         "tensors": []}
    h.update(over)
    return h


def expect_good_after(recv: Receiver, via: Sender | zmq.Socket, tag: str) -> None:
    """Send a good message and check it arrives. PULL fair-queues across connections, so to be sure
    it comes after a bad one, send it over the same connection (the raw socket)."""
    if isinstance(via, Sender):
        assert via.send("control", {"event": tag})
    else:
        via.send_multipart(encode("control", {"event": tag}, {}, key=KEY, sender="good", seq=0))
    msg = recv.recv(TIMEOUT_MS)
    assert msg is not None and msg.kind == "control" and msg.meta == {"event": tag}


# ------------------------------------------------------------------ wire, no sockets


def test_encode_decode_all_dtypes_bit_exact():
    g = torch.Generator().manual_seed(1)
    tensors = {
        "f32": torch.randn(3, 4, generator=g), "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(), "f16": torch.randn(7, generator=g).half(),
        "i64": torch.randint(-2**62, 2**62, (4,), generator=g),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8), "b": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 5), "scalar": torch.tensor(2.5),
        "strided": torch.arange(12).view(3, 4).t(),  # non-contiguous: sent as its C-order copy
        "fp8": torch.tensor([0.5, -3.0]).to(torch.float8_e4m3fn),
    }
    frames = encode("control", {"x": [1, "a"]}, tensors, key=KEY, sender="s", seq=7)
    msg = decode([bytes(f) for f in frames], key=KEY)
    assert (msg.kind, msg.seq, msg.sender, msg.meta) == ("control", 7, "s", {"x": [1, "a"]})
    assert list(msg.tensors) == list(tensors)
    for name, t in tensors.items():
        got = msg.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.contiguous().view(-1).view(torch.uint8),
                           t.contiguous().view(-1).view(torch.uint8)), name


def test_mac_matches_independent_reference_and_parallel_hashing():
    big = bytes(range(256)) * (CHUNK * 5 // 2 // 256)  # 2.5 chunks: pieces of 1, 1, 0.5 MiB
    frames = [memoryview(b"head"), memoryview(big), memoryview(b"")]
    ref = hmac.new(KEY, DOMAIN + struct.pack("<I", 3), hashlib.sha256)
    ref.update(struct.pack("<Q", 4) + blake3(b"head").digest())
    ref.update(struct.pack("<Q", len(big)))
    for i in range(0, len(big), CHUNK):
        ref.update(blake3(big[i:i + CHUNK]).digest())
    ref.update(struct.pack("<Q", 0))
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(3) as pool:
        assert compute_mac(frames, KEY, pool) == compute_mac(frames, KEY) == ref.digest()
    # moving one byte across a frame boundary changes the tag (lengths are authenticated)
    assert compute_mac([memoryview(b"ab"), memoryview(b"c")], KEY) != \
           compute_mac([memoryview(b"a"), memoryview(b"bc")], KEY)


@pytest.mark.parametrize("mutate, reason", [
    (lambda f: f[:-1], "truncated"),                      # MAC frame dropped
    (lambda f: [f[0], f[1], f[-1]], "truncated"),         # a tensor frame dropped
    (lambda f: [f[0]], "truncated"),
    (lambda f: f[:-1] + [f[-1][:16]], "truncated"),       # MAC cut short
    (lambda f: f[:1] + [f[1][:-4]] + f[2:], "bad_mac"),   # tensor bytes cut: lengths are in the tag
    (lambda f: f[:1] + [b"\x01" + f[1][1:]] + f[2:], "bad_mac"),
    (lambda f: f[:-1] + [bytes(32)], "bad_mac"),
    (lambda f: [b"not json"] + f[1:], "bad_header"),
    (lambda f: [b"[1, 2]"] + f[1:], "bad_header"),
])
def test_decode_rejections(mutate, reason):
    frames = [bytes(f) for f in encode("control", {}, {"a": torch.arange(4), "b": torch.ones(2)},
                                       key=KEY, sender="s", seq=0)]
    with pytest.raises(WireError) as e:
        decode(mutate(frames), key=KEY)
    assert e.value.reason == reason


def test_decode_rejects_forged_wrong_schema_and_bad_tensors():
    frames = encode("control", {}, {}, key=b"another-key-0000000", sender="s", seq=0)
    with pytest.raises(WireError, match="bad_mac"):
        decode(frames, key=KEY)
    cases = [
        (forge(good_header(schema=SCHEMA_VERSION + 1), []), "bad_schema"),
        (forge(good_header(kind="rpc"), []), "bad_header"),
        (forge(good_header(seq=-1), []), "bad_header"),
        (forge(good_header(seq=True), []), "bad_header"),
        (forge(good_header(sender=""), []), "bad_header"),
        (forge(good_header(tensors=[{"name": "x", "dtype": "object", "shape": [1]}]), [b"\0" * 8]),
         "bad_tensor"),
        (forge(good_header(tensors=[{"name": "x", "dtype": "int64", "shape": [2]}]), [b"\0" * 8]),
         "truncated"),
        (forge(good_header(tensors=[{"name": "x", "dtype": "int64", "shape": [1]}]), [b"\0" * 9]),
         "bad_tensor"),
        (forge(good_header(tensors=[{"name": "x", "dtype": "bool", "shape": [2]}]), [b"\x01\x02"]),
         "bad_tensor"),
        (forge(good_header(tensors=[{"name": "x", "dtype": "int8", "shape": [1]}] * 2), [b"a", b"b"]),
         "bad_header"),
        ([b'{"schema": NaN}', compute_mac([memoryview(b'{"schema": NaN}')], KEY)], "bad_header"),
    ]
    for frames, reason in cases:
        with pytest.raises(WireError) as e:
            decode(frames, key=KEY)
        assert e.value.reason == reason, frames[0]


def test_decode_limits_are_oversized():
    frames = encode("control", {"pad": "x" * 300}, {"a": torch.zeros(100)}, key=KEY, sender="s", seq=0)
    for limits in (Limits(max_frames=2), Limits(max_header_bytes=200),
                   Limits(max_message_bytes=400), Limits(max_tensor_elems=99)):
        with pytest.raises(WireError) as e:
            decode(frames, key=KEY, limits=limits)
        assert e.value.reason == "oversized", limits
    assert decode(frames, key=KEY, limits=Limits(max_tensor_elems=100)).tensors["a"].numel() == 100


def test_payload_check_overlapping_the_mac_never_outranks_it():
    from concurrent.futures import ThreadPoolExecutor

    trajs = batch(2)
    trajs[0].response_ids[0] = -3  # invalid payload
    meta, tensors = pack_trajectories(trajs)
    big = {**tensors, "pad": torch.zeros(300_000, dtype=torch.int64)}  # > 1 chunk: pool engaged

    def check(msg):
        validate_packed(msg.meta, {k: v for k, v in msg.tensors.items() if k != "pad"},
                        vocab_size=VOCAB, current_version=0, max_len=64)
        return "checked"

    with ThreadPoolExecutor(2) as pool:
        forged = encode("trajectory", meta, big, key=b"some-other-key-123", sender="s", seq=0)
        with pytest.raises(WireError) as e:
            decode(forged, key=KEY, pool=pool, check=check)
        assert e.value.reason == "bad_mac"  # forged and invalid: counted as forged
        msg = decode(encode("trajectory", meta, big, key=KEY, sender="s", seq=0), key=KEY,
                     pool=pool, check=check)
        assert msg.payload is None and msg.check_error.reason == "invalid"  # deferred to caller
        trajs[0].response_ids[0] = 3
        meta, tensors = pack_trajectories(trajs)
        msg = decode(encode("trajectory", meta, {**tensors, "pad": big["pad"]}, key=KEY, sender="s",
                            seq=1), key=KEY, pool=pool, check=check)
        assert msg.payload == "checked" and msg.check_error is None


def test_encode_refuses_what_the_schema_cannot_carry():
    with pytest.raises(ValueError, match="strict JSON"):
        encode("control", {"x": float("nan")}, {}, key=KEY, sender="s", seq=0)
    with pytest.raises(ValueError, match="kind"):
        encode("rpc", {}, {}, key=KEY, sender="s", seq=0)
    with pytest.raises(ValueError, match="key"):
        encode("control", {}, {}, key=b"short", sender="s", seq=0)
    with pytest.raises(ValueError, match="dtype"):
        encode("control", {}, {"c": torch.zeros(2, dtype=torch.complex64)}, key=KEY, sender="s", seq=0)


def test_pack_unpack_trajectories_lossless_and_views():
    trajs = batch(6) + [make_traj("empty", 0, 2, 0)]
    meta, tensors = pack_trajectories(trajs)
    assert tensors["response_offsets"].tolist()[-1] == sum(t.response_ids.numel() for t in trajs)
    back = unpack_trajectories(meta, tensors)
    for a, b in zip(trajs, back):
        assert_traj_equal(a, b)
    # views, not copies: the unpacked ids live inside the packed tensor
    assert back[1].response_ids.data_ptr() == tensors["response_ids"].data_ptr() + 8 * 4
    assert pack_trajectories([]) is not None and unpack_trajectories(*pack_trajectories([])) == []


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.response_ids.__setitem__(0, VOCAB), "token id outside"),
    (lambda t: t.prompt_ids.__setitem__(1, -1), "token id outside"),
    (lambda t: t.versions.__setitem__(-1, 4), "future"),
    (lambda t: t.versions.__setitem__(0, -1), "negative version"),
    (lambda t: t.versions[5:].fill_(1), "decreases"),
    (lambda t: t.behav_logp.__setitem__(2, float("nan")), "not finite"),
    (lambda t: t.behav_logp.__setitem__(2, float("-inf")), "not finite"),
    (lambda t: t.behav_logp.__setitem__(2, 0.01), "> 0"),
    (lambda t: setattr(t, "reward", float("inf")), "reward"),
    (lambda t: setattr(t, "behav_entropy", -torch.ones(t.response_ids.numel())), "behav_entropy < 0"),
    (lambda t: setattr(t, "behav_entropy", torch.full((t.response_ids.numel(),), float("inf"))),
     "behav_entropy infinite"),
    (lambda t: setattr(t, "behav_entropy", torch.ones(3)), "lengths"),
    (lambda t: setattr(t, "finish_reason", "eos"), "finish_reason"),
    (lambda t: setattr(t, "response_ids", torch.zeros(65, dtype=torch.int64)), "lengths"),
])
def test_validate_trajectories_names_the_culprit(edit, match):
    trajs = batch(4, version=2)
    validate_trajectories(trajs, vocab_size=VOCAB, current_version=3, max_len=64)  # fine as made
    edit(trajs[2])
    with pytest.raises(WireError) as e:
        validate_trajectories(trajs, vocab_size=VOCAB, current_version=3, max_len=64)
    assert e.value.reason == "invalid" and match in e.value.detail
    if match != "lengths":
        assert "trajectory 2 ('p1', sample 0)" in e.value.detail


def test_validate_versions_may_rise_along_a_response_and_reset_between_responses():
    a, b = make_traj("a", 0, 2, 4), make_traj("b", 0, 2, 3)
    a.versions.copy_(torch.tensor([1, 1, 2, 3]))  # partial rollout: weights updated mid-response
    b.versions.copy_(torch.tensor([0, 0, 1]))     # next response starts older: legal boundary
    validate_trajectories([a, b], vocab_size=VOCAB, current_version=3, max_len=8)
    with pytest.raises(WireError, match="longer than max_len"):
        validate_trajectories([a, b], vocab_size=VOCAB, current_version=3, max_len=3)


def test_validate_packed_structure():
    meta, tensors = pack_trajectories(batch(3))
    bad = dict(tensors, response_offsets=tensors["response_offsets"].flip(0))
    with pytest.raises(WireError, match="bad_tensor"):
        validate_packed(meta, bad, vocab_size=VOCAB, current_version=0, max_len=64)
    with pytest.raises(WireError, match="bad_header"):
        validate_packed({**meta, "finish_reasons": ["stop"]}, tensors, vocab_size=VOCAB,
                        current_version=0, max_len=64)


# ------------------------------------------------------------------ sockets


def test_socket_round_trip_bit_exact(link):
    recv, send, _ = link
    trajs = batch(7, version=3)
    assert send.send("trajectory", *pack_trajectories(trajs))
    msg = recv.recv(TIMEOUT_MS)
    assert msg is not None and msg.kind == "trajectory" and msg.seq == 0
    assert msg.sender == send.sender_id
    assert len(msg.payload) == 7
    for a, b in zip(trajs, msg.payload):
        assert_traj_equal(a, b)
    assert recv.rejects == {} and recv.received == 1 and recv.recv(50) is None


@pytest.mark.parametrize("case", ["forged", "truncated", "oversized", "oversized_frames",
                                  "replay", "wrong_schema", "bad_token", "future_version",
                                  "nan_logp", "unexpected_kind"])
def test_socket_rejects_are_counted_and_receiver_keeps_working(link, case):
    recv, send, raw = link
    reason = {"forged": "bad_mac", "truncated": "truncated", "oversized": "oversized",
              "oversized_frames": "oversized", "replay": "replay", "wrong_schema": "bad_schema",
              "bad_token": "invalid", "future_version": "invalid", "nan_logp": "invalid",
              "unexpected_kind": "unexpected_kind"}[case]
    trajs = batch(2, version=3)
    if case == "bad_token":
        trajs[1].response_ids[0] = VOCAB + 5
    elif case == "future_version":
        trajs[0].versions[-1] = 4
    elif case == "nan_logp":
        trajs[1].behav_logp[1] = float("nan")
    meta, tensors = pack_trajectories(trajs)
    frames = encode("trajectory", meta, tensors, key=KEY, sender="w9", seq=5)
    if case == "forged":
        frames = encode("trajectory", meta, tensors, key=b"not-the-run-key!", sender="w9", seq=5)
    elif case == "truncated":
        frames = frames[:3] + frames[-1:]
    elif case == "oversized":
        # 2 x 40 KB: each frame passes the transport's per-frame cap, the message exceeds 64 KiB
        frames = encode("control", {}, {"a": torch.zeros(5000, dtype=torch.int64),
                                        "b": torch.zeros(5000, dtype=torch.int64)},
                        key=KEY, sender="w9", seq=5)
    elif case == "oversized_frames":
        frames = forge(good_header(tensors=[{"name": f"t{i}", "dtype": "uint8", "shape": [1]}
                                            for i in range(20)]), [b"\0"] * 20)
    elif case == "wrong_schema":
        frames = forge(good_header(schema=0), [])
    elif case == "unexpected_kind":
        frames = encode("prompt", *pack_prompt(PromptTask("u", torch.tensor([1]), SamplingParams(),
                                                          1, 0)), key=KEY, sender="w9", seq=5)
    if case == "replay":
        raw.send_multipart(frames)
        first = recv.recv(TIMEOUT_MS)
        assert first is not None and first.seq == 5  # the original is accepted once...
    raw.send_multipart(frames)
    expect_good_after(recv, raw, case)              # ...the bad one is skipped, the good one arrives
    assert recv.rejects == {reason: 1}
    # the same sender id keeps working with a fresh seq
    if case == "replay":
        raw.send_multipart(encode("control", {}, {}, key=KEY, sender="w9", seq=6))
        assert recv.recv(TIMEOUT_MS).seq == 6


def test_restarted_sender_is_not_a_replay(link):
    recv, send, _ = link
    again = Sender(recv.endpoint, KEY, name="w0", linger_ms=0)  # same name, fresh process state
    try:
        assert send.send("control", {"i": 0}) and again.send("control", {"i": 1})
        got = {recv.recv(TIMEOUT_MS).meta["i"], recv.recv(TIMEOUT_MS).meta["i"]}
        assert got == {0, 1} and send.sender_id != again.sender_id and recv.rejects == {}
    finally:
        again.close()


def test_transport_cuts_frames_above_the_cap_and_receiver_recovers(link):
    recv, send, raw = link
    raw.send_multipart([b"x" * (1 << 17)])  # one frame > max_message_bytes: libzmq drops the peer
    expect_good_after(recv, send, "after-cut")
    assert recv.rejects == {}  # cut by libzmq before decoding: never allocated, never counted


def test_prompt_messages_round_trip_and_validate():
    recv = Receiver("tcp://127.0.0.1:0", KEY, kinds=("prompt",), vocab_size=VOCAB, max_len=16)
    send = Sender(recv.endpoint, KEY, bind=False, linger_ms=0)
    try:
        task = PromptTask("q-17", torch.tensor([5, 6, 7]),
                          SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, seed=3,
                                         stop_token_ids=(2,)), group_size=4, version=2)
        assert send.send("prompt", *pack_prompt(task))
        got = recv.recv(TIMEOUT_MS).payload
        assert (got.prompt_uid, got.params, got.group_size, got.version) == \
               (task.prompt_uid, task.params, task.group_size, task.version)
        assert torch.equal(got.prompt_ids, task.prompt_ids)
        bad = PromptTask("q-18", torch.tensor([5, VOCAB]), SamplingParams(), 4, 2)
        assert send.send("prompt", *pack_prompt(bad)) and send.send("prompt", *pack_prompt(task))
        assert recv.recv(TIMEOUT_MS).payload.prompt_uid == "q-17"
        assert recv.rejects == {"invalid": 1}
    finally:
        send.close()
        recv.close()


def test_receiver_requires_validation_parameters_for_typed_kinds():
    with pytest.raises(ValueError, match="vocab_size"):
        Receiver("tcp://127.0.0.1:0", KEY, kinds=("trajectory",))
    with pytest.raises(ValueError, match="key"):
        Receiver("tcp://127.0.0.1:0", b"short")


def test_back_pressure_no_peer_and_full_queue():
    # A bound PUSH with nobody connected has nowhere to queue: a non-blocking send is refused.
    lonely = Sender("tcp://127.0.0.1:0", KEY, bind=True, linger_ms=0)
    try:
        assert not lonely.send("control", {}, block=False)
        assert not lonely.send("control", {}, timeout_ms=20)
        assert lonely.not_sent == 2 and lonely.seq == 0
    finally:
        lonely.close()
    # A stalled receiver: queues (HWM 2 each side, small kernel buffers) fill, then sends are refused.
    recv = Receiver("tcp://127.0.0.1:0", KEY, kinds=("control",), hwm=2, rcvbuf=1 << 16)
    send = Sender(recv.endpoint, KEY, hwm=2, sndbuf=1 << 16, linger_ms=0)
    try:
        assert send.send("control", {"i": -1}) and recv.recv(TIMEOUT_MS) is not None  # connected
        payload = {"x": torch.zeros(1 << 15, dtype=torch.int64)}  # 256 KiB per message
        refused = 0
        for i in range(400):
            if not send.send("control", {"i": i}, payload, block=False):
                refused += 1
                break
        assert refused == 1, "queue never filled"
        queued = send.sent - 1
        got = [recv.recv(TIMEOUT_MS).meta["i"] for _ in range(queued)]
        assert got == list(range(queued))  # nothing lost or reordered; refused one never sent
        assert recv.recv(50) is None
        assert send.send("control", {"i": "after"}, block=False) or send.send("control", {"i": "after"})
        assert recv.recv(TIMEOUT_MS).meta == {"i": "after"}
    finally:
        send.close()
        recv.close()


def test_bench_stream_runs_small():
    from qurl.research.bench.stream import bench_stream

    out = bench_stream(total_mb=4, msg_mb=1, prompt_len=16, response_len=64, processes=False,
                       gc_freeze=False, verbose=False)
    assert out["auth"]["rejects"] == {}
    assert out["raw"]["bytes"] > 0 and out["auth"]["bytes"] > 0
    assert math.isfinite(out["auth_over_raw"]) and out["auth_over_raw"] > 0
