"""Delta weight sync (qurl/weights/delta.py, plan.py, digest.py) and its local-engine receiver.

Closed-form checks of the encoding (exact byte counts, which of delta/full is chosen, round trips
bit for bit over block boundaries and every wire dtype), of the planner's choices, and of the local
engine: deltas applied in place give exactly a fresh full load, a stale base is refused before
anything is written, and a corrupted engine (or delta) is caught by the digests and resynced.
"""
from __future__ import annotations

import pytest
import torch

from qurl.types import StaleBase
from qurl.engines.local import LocalEngine
from qurl.models.hf import build_model, read_state_dict
from qurl.quant.named import engine_chunks
from qurl.weights.plan import SyncPlanner, broadcast_chunks
from qurl.weights.publish import WeightSync
from qurl.weights import delta as D
from qurl.weights.digest import combine, named_digests, tensor_digest


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs with one torch thread (conftest.one_thread)."""


def _flip(t: torch.Tensor, pos: list[int]) -> torch.Tensor:
    """t with the bits at flat positions `pos` changed (xor 1 on the integer view)."""
    out = t.clone()
    bits = out.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    bits[torch.tensor(pos)] ^= 1
    return out


# ------------------------------------------------------------------ encoding

@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.bfloat16, torch.float32])
def test_roundtrip_across_blocks_is_bit_exact(dtype):
    g = torch.Generator().manual_seed(0)
    prev = (torch.randn(3, 70_000, generator=g) * 3).to(dtype) if dtype != torch.int8 else \
        torch.randint(-127, 128, (3, 70_000), generator=g, dtype=torch.int8)
    # low 16 bits 0, 32767, 32768 (int16 sign), 65535, then the next block, and the very last one
    pos = [0, 32767, 32768, 65535, 65536, 100_000, 131_071, 131_072, 209_999]
    new = _flip(prev, pos)
    chunks = D.encode_tensor("w", prev, new)
    assert [n for n, _ in chunks] == ["w#dpos", "w#dend", "w#dval"]
    assert sum(c.numel() * c.element_size() for _, c in chunks) == \
        D.delta_nbytes(len(pos), new.numel(), new.element_size()) == \
        len(pos) * (2 + new.element_size()) + 4 * 4  # 210000 elements: 4 blocks of 2^16
    got = D.apply_named({"w": prev}, chunks)["w"]
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), new.view(torch.uint8))
    assert torch.equal(prev.view(torch.uint8), prev.view(torch.uint8))  # base untouched


def test_a_single_change_packs_on_the_wire():
    from qurl.weights.buckets import align_order, layout_of, pack, unpack

    prev = torch.zeros(70_000, dtype=torch.int8)
    chunks = align_order(D.encode_tensor("w", prev, _flip(prev, [69_999])))
    got = dict(unpack(pack(chunks, layout_of(chunks)), layout_of(chunks)))
    assert D.apply_named({"w": prev}, got.items())["w"][69_999] == 1


def test_fp8_signed_zero_is_a_change():
    prev = torch.zeros(10, dtype=torch.float8_e4m3fn)
    new = prev.clone()
    new[3] = -0.0  # equal as floats, different bits
    assert D.changed_positions(prev, new).tolist() == [3]


def test_size_choice_unchanged_delta_full():
    prev = torch.zeros(1000, dtype=torch.int8)
    assert D.encode_tensor("w", prev, prev.clone()) == []
    # delta costs 3 bytes per change + 4: up to 331 changes it beats 1000 bytes
    small = D.encode_tensor("w", prev, _flip(prev, list(range(331))))
    assert len(small) == 3
    big = D.encode_tensor("w", prev, _flip(prev, list(range(332))))  # 1000 bytes: a tie
    assert [n for n, _ in big] == ["w"]
    assert D.encode_tensor("w", None, prev)[0][0] == "w"


def test_encode_named_counts_bytes():
    a = torch.zeros(100, 100, dtype=torch.int8)
    s = torch.ones(100, 1)
    e = torch.zeros(50, dtype=torch.bfloat16)
    prev = {"a": a, "a_scale": s, "e": e}
    new = [("a", _flip(a, [5, 9000])), ("a_scale", s.clone()), ("e", _flip(e, list(range(40))))]
    chunks, st = D.encode_named(prev, new)
    assert (st.same, st.delta, st.full) == (1, 1, 1)
    assert st.full_bytes == 10_000 + 400 + 100
    assert st.bytes == 2 * 3 + 4 + 100  # a: 2 changes + 1 block end; e: whole (40*4 > 100)
    assert st.changed == 2 + 40
    out = D.apply_named(prev, chunks)
    for n, t in new:
        assert torch.equal(out[n].view(torch.uint8), t.view(torch.uint8))


def test_bad_deltas_are_refused_naming_the_tensor():
    prev = torch.zeros(100, dtype=torch.int8)
    pos, ends, val = [t for _, t in D.encode_tensor("w", prev, _flip(prev, [2, 7]))]
    with pytest.raises(ValueError, match="w#dpos: positions must be strictly ascending"):
        D.apply_named({"w": prev}, [("w#dpos", pos.flip(0)), ("w#dend", ends), ("w#dval", val)])
    with pytest.raises(ValueError, match="outside 100 elements"):
        D.apply_named({"w": prev}, [("w#dpos", pos + 95), ("w#dend", ends), ("w#dval", val)])
    with pytest.raises(ValueError, match="w#dval: expected torch.int8"):
        D.apply_named({"w": prev}, [("w#dpos", pos), ("w#dend", ends), ("w#dval", val.float())])
    with pytest.raises(ValueError, match="delta without its #dval"):
        D.apply_named({"w": prev}, [("w#dpos", pos), ("w#dend", ends)])


def test_digest_sees_one_byte_and_a_reinterpretation():
    t = torch.arange(64, dtype=torch.int8)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(t) != tensor_digest(_flip(t, [63]))
    assert tensor_digest(t) != tensor_digest(t.view(torch.uint8))
    assert combine({"a": "1", "b": "2"}) == combine({"b": "2", "a": "1"}) != combine({"a": "1"})


# ------------------------------------------------------------------ planner

def test_planner_choices_and_reasons():
    a = torch.zeros(1000, dtype=torch.int8)
    v = [[("a", a)], [("a", _flip(a, [1]))], [("a", _flip(a, [1, 2]))], [("a", _flip(a, [3]))]]
    p = SyncPlanner("delta", full_every=3)
    p0 = p.plan(v[0], 0, holder=None)
    assert (p0.mode, p0.reason, p0.stats.bytes) == ("full", "first", 1000)
    p1 = p.plan(v[1], 1, holder=(0, p0.digest))
    assert (p1.mode, p1.base, p1.stats.bytes) == ("delta", (0, p0.digest), 3 + 4)
    p2 = p.plan(v[2], 2, holder=(1, "something else"))
    assert (p2.mode, p2.reason) == ("full", "holder")
    p3 = p.plan(v[3], 3, holder=(2, p2.digest))
    assert p3.mode == "delta"
    p4 = p.plan(v[0], 4, holder=(3, p3.digest))
    assert p4.mode == "delta"
    p5 = p.plan(v[1], 5, holder=(4, p4.digest))  # v2 full, v3 and v4 deltas: v5 is the 3rd
    assert (p5.mode, p5.reason) == ("full", "periodic")
    assert p.metrics() == {"sync/fallbacks/first": 1.0, "sync/fallbacks/holder": 1.0,
                           "sync/fallbacks/periodic": 1.0}
    off = SyncPlanner("full")
    off.plan(v[0], 0, None)
    assert off.plan(v[1], 1, holder=off.last).reason == "off"
    assert p1.digests == named_digests(v[1]) and p1.digest == combine(p1.digests)


# ------------------------------------------------------------------ the local engine

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "tiny2", "tiny", seed=1,
                       overrides={"num_hidden_layers": 2, "initializer_range": 0.1})


def _versions(model_dir, n: int, step: float = 2e-3, seed: int = 0):
    """n successive fp32 weight versions: each moves every weight by N(0, step^2) on a random
    quarter of its entries (sparse and small, like an RL step under Adam)."""
    g = torch.Generator().manual_seed(seed)
    named = {k: v.float() for k, v in read_state_dict(model_dir).items()}
    out = []
    for _ in range(n):
        out.append([(k, v.clone()) for k, v in named.items()])
        for k, v in named.items():
            mask = torch.rand(v.shape, generator=g) < 0.25
            v += mask * torch.randn(v.shape, generator=g) * step
    return out


def _same(engine: LocalEngine, ref: LocalEngine) -> bool:
    a, b = engine.model.state_dict(), ref.model.state_dict()
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_engine_after_delta_syncs_equals_a_fresh_full_sync(model_dir, precision):
    versions = _versions(model_dir, 8)
    engine = LocalEngine(model_dir, precision=precision)
    sync = WeightSync(precision)
    recs = [sync.push(iter(named), engine, v) for v, named in enumerate(versions)]
    assert [r["sync/delta"] for r in recs] == [0.0] + [1.0] * 7
    assert all(r["sync/verified"] == 1.0 for r in recs)
    assert all(r["sync/bytes"] < r["sync/full_bytes"] for r in recs[1:])
    assert recs[0]["sync/bytes"] == recs[0]["sync/full_bytes"]
    fresh = LocalEngine(model_dir, precision=precision)
    WeightSync(precision, mode="full").push(iter(versions[-1]), fresh, 7)
    assert engine.version == fresh.version == 7 and engine.digest == fresh.digest
    assert _same(engine, fresh)


def test_corrupted_engine_is_caught_and_resynced(model_dir):
    versions = _versions(model_dir, 3, seed=1)
    engine = LocalEngine(model_dir, precision="int8")
    sync = WeightSync("int8")
    sync.push(iter(versions[0]), engine, 0)
    sync.push(iter(versions[1]), engine, 1)
    name = "model.layers.1.mlp.down_proj.weight"
    c1, c2 = (dict(engine_chunks(iter(v), "int8"))[name].reshape(-1) for v in versions[1:])
    pos = int((c1 == c2).nonzero()[0])  # a code v2 does not change: only verification can see it
    live = dict(engine.model.state_dict(keep_vars=True))[name]
    with torch.no_grad():
        live.view(-1)[pos] += 1  # one code, changed behind the sync's back
    rec = sync.push(iter(versions[2]), engine, 2)
    assert rec["sync/delta"] == 1.0  # the engine still claims v1: the delta is sent
    assert (rec["sync/verified"], rec["sync/verify_mismatches"]) == (0.0, 1.0)
    assert rec["sync/fallbacks/mismatch"] == rec["sync/resync/mismatch"] == 1.0
    assert rec["sync/bytes"] > rec["sync/full_bytes"]  # the delta, then everything again
    fresh = LocalEngine(model_dir, precision="int8")
    WeightSync("int8", mode="full").push(iter(versions[2]), fresh, 2)
    assert _same(engine, fresh) and engine.digest == fresh.digest


def test_a_bit_below_the_wire_precision_is_caught(model_dir):
    """The local engine holds fp32; a sync in bf16 fills it with bf16 values. A corrupted low
    bit of the fp32 mantissa vanishes in the cast to bf16, so hashing the cast would pass: the
    engine checks every bit it holds (issue 60: verify what the kernels read)."""
    (named,) = _versions(model_dir, 1, seed=3)
    engine = LocalEngine(model_dir, precision="int8")
    sync = WeightSync("int8", wire_dtype=torch.bfloat16, mode="full")
    assert sync.push(iter(named), engine, 0)["sync/verified"] == 1.0
    digests = named_digests(WeightSync("int8", wire_dtype=torch.bfloat16).quantize(iter(named))[0])
    assert engine.verify(digests) == []
    live = dict(engine.model.state_dict(keep_vars=True))["model.norm.weight"]
    assert live.dtype == torch.float32
    before = live.to(torch.bfloat16)
    with torch.no_grad():
        live.view(torch.int32).view(-1)[3] ^= 1  # the lowest mantissa bit: bf16 cannot see it
    assert torch.equal(live.to(torch.bfloat16), before)
    assert engine.verify(digests) == ["model.norm.weight"] and engine.digest is None


def test_corrupted_delta_is_caught(model_dir, monkeypatch):
    versions = _versions(model_dir, 2, seed=2)
    engine = LocalEngine(model_dir, precision="int8")
    sync = WeightSync("int8")
    sync.push(iter(versions[0]), engine, 0)
    real = D.encode_named

    def corrupt(prev, new, positions=None):
        chunks, st = real(prev, new, positions)
        i = next(i for i, (n, _) in enumerate(chunks) if n.endswith("#dval"))
        chunks[i] = (chunks[i][0], _flip(chunks[i][1], [0]))  # a wrong value on the wire
        return chunks, st

    monkeypatch.setattr("qurl.weights.plan.encode_named", corrupt)
    rec = sync.push(iter(versions[1]), engine, 1)
    assert (rec["sync/delta"], rec["sync/verified"]) == (1.0, 0.0)
    assert rec["sync/fallbacks/mismatch"] == 1.0 and engine.digest is not None


def test_stale_base_is_refused_before_any_write(model_dir):
    versions = _versions(model_dir, 3, seed=3)
    engine = LocalEngine(model_dir, precision="int8")
    planner = SyncPlanner()
    chunks = [list(engine_chunks(iter(v), "int8")) for v in versions]
    p0 = planner.plan(chunks[0], 0, None)
    engine.load_weights(iter(p0.chunks), 0)
    assert engine.verify(p0.digests) == [] and engine.digest == p0.digest
    planner.plan(chunks[1], 1, holder=(0, p0.digest))  # v1 planned, never delivered
    p2 = planner.plan(chunks[2], 2, holder=(1, "x"))
    assert p2.reason == "holder"  # the planner will not send a delta to an unknown holder ...
    bad = SyncPlanner()
    bad.plan(chunks[1], 1, None)
    delta = bad.plan(chunks[2], 2, holder=bad.last)  # ... and the engine refuses one anyway
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(StaleBase, match="this engine holds v0"):
        engine.load_weights(iter(delta.chunks), 2, base=delta.base)
    assert engine.version == 0 and engine.digest == p0.digest
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    with pytest.raises(ValueError, match="#dpos: no tensor of that name"):
        engine.load_weights(iter(delta.chunks), 2)


# ------------------------------------------------------------------ a receiver in another process

def _engine_receiver(port: int, model_dir: str, precision: str, ann_q, ack_q) -> None:
    """Rank 1 of a gloo weight group: a LocalEngine fed by the WeightReceiver, as an async
    rollout worker runs it (double-banked buffers, deltas, verification after every sync)."""
    torch.set_num_threads(1)
    from qurl.weights.receiver import WeightReceiver
    from qurl.weights.group import WeightGroup

    group = WeightGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=120)
    engine = LocalEngine(model_dir, precision=precision)
    rx = WeightReceiver(group, engine)
    while True:
        first = ann_q.get(timeout=120)
        if first is None:
            break
        pending = [first]
        try:
            stats = rx.receive(lambda: pending.pop() if pending else ann_q.get(timeout=120))
        except StaleBase as e:
            ack_q.put({"refused": str(e)})
            continue
        bad = engine.verify(stats.header["digests"])
        ack_q.put({"version": engine.version, "digest": engine.digest, "bad": bad,
                   "adopted": engine.adopted, "bytes": stats.bytes})
    ack_q.put({"state": named_digests(engine.model.state_dict().items())})
    group.close()


def gloo_replay(model_dir, precision: str, versions: list, corrupt_at: int | None = None) -> dict:
    """Sync `versions` (fp32 named weights) to a LocalEngine in another process over a gloo
    WeightGroup with the planner's deltas; returns the acks and the engine's final state digests.
    corrupt_at: that version's delta goes out with one value changed (a transport bug)."""
    import multiprocessing as mp

    from qurl.weights.group import WeightGroup, free_port
    from qurl.weights.sender import WeightSender

    ctx = mp.get_context("spawn")
    ann_q, ack_q = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_engine_receiver, args=(port, str(model_dir), precision, ann_q, ack_q),
                       daemon=True)
    proc.start()
    acks, plans = [], []
    try:
        group = WeightGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=120)
        sender = WeightSender(group, bucket_bytes=1 << 20)  # several buckets per sync
        planner = SyncPlanner()
        holder = None
        for v, named in enumerate(versions):
            chunks = list(engine_chunks(iter(named), precision))
            plan = planner.plan(chunks, v, holder)
            wire = list(broadcast_chunks(plan, chunks))  # as the fleet sends it
            if v == corrupt_at:
                i = next(i for i, (n, _) in enumerate(wire) if n.endswith("#dval"))
                wire[i] = (wire[i][0], _flip(wire[i][1], [0]))
            header = plan.header()
            sender.send(wire, v, announce=lambda a: ann_q.put(
                {**a.to_dict(), **({"sync": header} if a.index == 0 else {})}))
            ack = ack_q.get(timeout=120)
            if ack.get("bad"):  # as the worker does: ask for everything again
                plan = planner.full(plan, chunks, "mismatch")
                header = plan.header()
                sender.send(plan.chunks, v, announce=lambda a: ann_q.put(
                    {**a.to_dict(), **({"sync": header} if a.index == 0 else {})}))
                ack = {**ack_q.get(timeout=120), "resynced": True}
            acks.append(ack)
            plans.append(plan)
            holder = (ack["version"], ack["digest"]) if ack.get("digest") else None
        ann_q.put(None)
        state = ack_q.get(timeout=120)["state"]
        group.close()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return {"acks": acks, "plans": plans, "state": state}


def test_receiver_process_applies_deltas_and_catches_a_corrupted_one(model_dir):
    versions = _versions(model_dir, 5, step=5e-4, seed=4)
    out = gloo_replay(model_dir, "int8", versions, corrupt_at=3)
    modes = [p.mode for p in out["plans"]]
    assert modes == ["full", "delta", "delta", "full", "delta"]  # v3: delta, bad, then full
    assert [a["bad"] == [] for a in out["acks"]] == [True, True, True, True, True]
    assert out["acks"][3].get("resynced") and not out["acks"][2].get("resynced")
    assert all(a["bytes"] < 0.5 * p.stats.full_bytes
               for a, p in zip(out["acks"][1:], out["plans"][1:]) if p.mode == "delta")
    fresh = LocalEngine(model_dir, precision="int8")
    WeightSync("int8", mode="full").push(iter(versions[-1]), fresh, 4)
    assert out["state"] == named_digests(fresh.model.state_dict().items())


def test_an_unchanged_version_replays_over_gloo(model_dir):
    """A step without gradient publishes the same weights twice: the delta is empty, the
    broadcast carries the smallest tensor whole (broadcast_chunks, as the fleet does), and the
    receiving process verifies and ends holding that version."""
    v0 = _versions(model_dir, 1)[0]
    out = gloo_replay(model_dir, "int8", [v0, [(n, t.clone()) for n, t in v0]])
    assert [p.mode for p in out["plans"]] == ["full", "delta"]
    assert out["plans"][1].chunks == [] and out["plans"][1].stats.same == len(out["plans"][0].chunks)
    assert [(a["version"], a["bad"]) for a in out["acks"]] == [(0, []), (1, [])]


# ------------------------------------------------------------------ a real training run


@pytest.mark.slow
@pytest.mark.timeout(3000)  # 25 RL steps; minutes on a loaded 2-core machine
def test_twenty_delta_syncs_of_a_run_equal_a_full_sync_and_train_the_same(runs_dir, monkeypatch):
    """A 20-step sync-loop run (tiny model, default lr) with delta sync: every sync after the
    first is a delta and verified; the run's engine and a receiver in another process (the async
    workers' path) fed the same 21 versions end byte-equal to a fresh full sync of the last one;
    and the same run with full syncs logs the same training metrics, step for step (5 steps)."""
    from pipeline_helpers import tiny_cfg, use_free_dist_port

    from qurl.commands.train import train
    from qurl.train.inline import InProcessRollout
    from qurl.train.metrics_log import metric_differences, read_metrics

    use_free_dist_port()
    root = runs_dir("delta20")
    captured, kept = [], {}
    push = WeightSync.push

    def spy(self, named, engine, version):
        if self.precision != "int8":  # the fp-policy evaluation engine's own bf16 pushes
            return push(self, named, engine, version)
        named = [(n, t.detach().clone()) for n, t in named]
        captured.append(named)
        return push(self, iter(named), engine, version)

    def close(self):  # keep the delta run's engine (the first run) for the comparison below
        if not kept:
            kept.update(engine=self.engine, model_dir=self.z.run.model_dir)

    monkeypatch.setattr(WeightSync, "push", spy)
    monkeypatch.setattr(InProcessRollout, "close", close)
    small = {"rollout.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 16,
             "optim.lr": 3e-5, "deploy.ckpt_every": 0, "data.train_size": 40}
    train(tiny_cfg(root, "delta", 20, **small))
    monkeypatch.setattr(WeightSync, "push", push)
    train(tiny_cfg(root, "full", 5, **small, **{"deploy.sync.mode": "full"}))

    recs = {m: [r for r in read_metrics(root / m / "metrics.jsonl") if r["kind"] == "train"]
            for m in ("delta", "full")}
    d = recs["delta"]
    assert len(captured) == 21 and [r["step"] for r in d] == list(range(1, 21))
    assert all(r["sync/delta"] == 1.0 and r["sync/verified"] == 1.0 for r in d)
    assert all(r["sync/bytes"] < r["sync/full_bytes"] for r in d)
    assert all(r["sync/bytes"] == r["sync/full_bytes"] for r in recs["full"])
    assert any(r["flip_frac"] > 0 for r in d) and any(r["grad_norm"] > 0 for r in d)
    assert len(recs["full"]) == 5
    # the policy cannot tell how its weights travelled
    assert metric_differences(d[:5], recs["full"], skip_prefixes=("sync/",)) == []

    engine, model_dir = kept["engine"], kept["model_dir"]
    fresh = LocalEngine(model_dir, precision="int8")
    WeightSync("int8", mode="full").push(iter(captured[-1]), fresh, 20)
    assert engine.version == 20 and _same(engine, fresh)
    out = gloo_replay(model_dir, "int8", captured)
    assert [p.mode for p in out["plans"]] == ["full"] + ["delta"] * 20
    assert all(a["bad"] == [] and not a.get("resynced") for a in out["acks"])
    assert out["state"] == named_digests(fresh.model.state_dict().items())
