"""Issue 60 item 1: a weight sync is idempotent — the same weights synced again change no bit.

ROCm ATOM#2028 is the failure this guards against: a conversion that ran at every sync (there, a
rescale applied to weights already rescaled) made the weights grow 2^N over N syncs. Here the same
master weights are pushed three times and, after each push, every tensor the engine holds is
compared bit for bit with what it held after the first: parameters and buffers of every module
(8-bit codes, their scales, norms, embeddings), the fused sibling GEMM's concatenated codes and
scales (qurl/engines/qlinear.py `Siblings`: the per-linear buffers are views of it), the fp8
widening cache, and the logits of a forward. The masters themselves must come back untouched
(UAQ's invariant scaling is applied once, when the learner loads the checkpoint:
qurl/learner/megatron.py; a sync that re-applied it, or quantized in place, would change them).

Two paths: WeightSync.push into a LocalEngine in this process (qurl/weights/publish.py), for every
precision the local engine has, UAQ on and off, delta and full mode; and the async worker's path,
a WeightReceiver feeding a LocalEngine in another process over a real gloo WeightGroup
(qurl/weights/receiver.py), with the planner's delta and full syncs.
"""
from __future__ import annotations

import pytest
import torch

from qurl.engines.local import PRECISIONS, LocalEngine
from qurl.models.hf import build_model, read_state_dict
from qurl.quant.uaq import apply_uaq
from qurl.weights.publish import WeightSync

PROMPT, OUTPUT = [1, 5, 9, 14], [3, 7, 2]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs with one torch thread (conftest.one_thread)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "tiny2", "tiny", seed=3,
                       overrides={"num_hidden_layers": 2, "initializer_range": 0.1})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def holdings(engine: LocalEngine) -> dict[str, torch.Tensor]:
    """Every tensor the engine holds, as raw bytes, by a name saying where it lives: each module's
    own parameters and buffers (views included: the fused siblings' members are views), the fused
    sibling modules' tensors and caches, tensor caches in module attributes, and the logits of a
    teacher-forced forward (which also refreshes the fused buffers after a load)."""
    out = {"logits": _bits(engine.token_logits(PROMPT, OUTPUT))}
    seen_sib: set[int] = set()
    for mname, mod in engine.model.named_modules(remove_duplicate=False):
        mods = [(mname, mod)]
        sib = mod.__dict__.get("_siblings")
        if sib is not None and id(sib[0]) not in seen_sib:
            seen_sib.add(id(sib[0]))
            mods.append((f"{mname}<fused>", sib[0].fused))
        for where, m in mods:
            for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                out[f"{where}.{n}"] = _bits(t)
            for k, v in m.__dict__.items():  # caches: fp8's widened codes (int8's fbgemm pack
                vals = v if isinstance(v, tuple) else (v,)  # is opaque; the logits cover it)
                for i, x in enumerate(vals):
                    if isinstance(x, torch.Tensor) and x.layout == torch.strided \
                            and not isinstance(x, torch.nn.Parameter) and k not in m._buffers:
                        out[f"{where}.{k}[{i}]"] = _bits(x)
    return out


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def _masters(model_dir, uaq: bool) -> list[tuple[str, torch.Tensor]]:
    named = {k: v.float() for k, v in read_state_dict(model_dir).items()}
    return list((apply_uaq(named, 2.0) if uaq else named).items())


@pytest.mark.parametrize("mode", ["delta", "full"])
@pytest.mark.parametrize("uaq", [False, True], ids=["uaq_off", "uaq_on"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_three_syncs_of_the_same_weights_change_no_bit(model_dir, precision, uaq, mode):
    masters = _masters(model_dir, uaq)
    before = {n: _bits(t) for n, t in masters}
    engine = LocalEngine(model_dir, precision=precision)
    sync = WeightSync(precision, mode=mode)
    recs, states = [], []
    for v in range(3):
        recs.append(sync.push(iter(masters), engine, v))
        states.append(holdings(engine))
        assert _diff({n: _bits(t) for n, t in masters}, before) == [], "a sync changed the masters"
    assert all(r["sync/verified"] == 1.0 for r in recs)
    assert _diff(states[0], states[1]) == [] and _diff(states[0], states[2]) == []
    assert len(states[0]) > len(dict(engine.model.state_dict()))  # the fused views were seen
    if mode == "delta":  # nothing changed, so nothing is sent but the planner's minimum
        assert [r["sync/delta"] for r in recs] == [0.0, 1.0, 1.0]
        assert all(r.get("flip_frac", 0.0) == 0.0 for r in recs[1:])


def test_the_check_sees_a_conversion_rerun_at_every_sync(model_dir, monkeypatch):
    """The ATOM#2028 bug, injected: UAQ's scaling re-applied, in place, inside every sync. The
    same check as above then finds the engine's norms and codes changed at the next sync."""
    real = WeightSync.quantize

    def rescale_again(self, named):
        named = dict(named)
        with torch.no_grad():
            for n, t in apply_uaq(named, 2.0).items():
                named[n].copy_(t)
        return real(self, iter(named.items()))

    monkeypatch.setattr(WeightSync, "quantize", rescale_again)
    masters = _masters(model_dir, uaq=True)
    engine = LocalEngine(model_dir, precision="int8")
    sync = WeightSync("int8")
    states = []
    for v in range(3):
        sync.push(iter(masters), engine, v)
        states.append(holdings(engine))
    assert "model.norm.weight" not in _diff(states[0], states[1])  # UAQ leaves the final norm
    bad = _diff(states[0], states[1])
    # s = 2 is exactly invariant: the logits do not move, only the weights grow (2x per sync)
    assert "logits" not in bad and "model.layers.0.input_layernorm.weight" in bad
    assert any(k.endswith("<fused>.weight_scale") for k in bad)


def _receiver(port: int, model_dir: str, precision: str, ann_q, ack_q) -> None:
    """Rank 1 of a gloo weight group: a LocalEngine fed by a WeightReceiver (double-banked,
    adopting buffers, as a rollout worker runs it); after each sync it verifies and sends back
    every tensor it holds."""
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
        stats = rx.receive(lambda: pending.pop() if pending else ann_q.get(timeout=120))
        bad = engine.verify(stats.header["digests"])
        ack_q.put({"version": engine.version, "digest": engine.digest, "bad": bad,
                   "adopted": engine.adopted, "held": holdings(engine)})
    group.close()


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_three_syncs_over_a_gloo_group_change_no_bit(model_dir, precision):
    """The async worker's path: full, then the same version's delta twice, then full twice more
    (the fleet's resync), each into the receiver's other buffer bank; every tensor the receiving
    engine holds stays bit-identical to what it held after the first sync."""
    import multiprocessing as mp

    from qurl.quant.named import engine_chunks
    from qurl.weights.plan import SyncPlanner, broadcast_chunks
    from qurl.weights.group import WeightGroup, free_port
    from qurl.weights.sender import WeightSender

    masters = _masters(model_dir, uaq=True)
    ctx = mp.get_context("spawn")
    ann_q, ack_q = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_receiver, args=(port, str(model_dir), precision, ann_q, ack_q),
                       daemon=True)
    proc.start()
    acks, modes = [], []
    try:
        group = WeightGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=120)
        sender = WeightSender(group, bucket_bytes=1 << 16)  # several buckets per sync
        planner, holder = SyncPlanner(), None
        for v, force_full in enumerate([False, False, False, True, True]):
            chunks = list(engine_chunks(iter(masters), precision))
            plan = planner.plan(chunks, v, None if force_full else holder)
            header = plan.header()
            sender.send(list(broadcast_chunks(plan, chunks)), v, announce=lambda a: ann_q.put(
                {**a.to_dict(), **({"sync": header} if a.index == 0 else {})}))
            acks.append(ack_q.get(timeout=120))
            modes.append(plan.mode)
            holder = (acks[-1]["version"], acks[-1]["digest"])
        ann_q.put(None)
        group.close()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert modes == ["full", "delta", "delta", "full", "full"]
    assert [a["bad"] for a in acks] == [[]] * 5
    assert acks[0]["adopted"] and acks[3]["adopted"]  # full syncs land in the other bank
    for a in acks[1:]:
        assert _diff(acks[0]["held"], a["held"]) == []
