"""Weight sync: byte buckets, announcements, engine chunks, and a real two-process gloo sync into a
LocalEngine (learner-side Sender here, receiver in a spawned process)."""
from __future__ import annotations

import multiprocessing as mp
import queue

import pytest
import torch

from qurl.quant.formats import dequantize_fp8_block, quantize_fp8_block
from qurl.quant.named import engine_chunks, quantize_named
from qurl.weights.arena import ArenaQuantizer, ChunkArena
from qurl.weights.buckets import (BucketLayout, align_order, bucket_buffer, group_pairs, layout_of,
                               pack, plan_buckets, unpack)
from qurl.weights.group import WeightGroup, free_port
from qurl.weights.sender import BucketAnnouncement, WeightSender


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    codes, scale = quantize_named([("model.layers.0.mlp.up_proj.weight", w)], "int8")
    return [("a.norm", torch.randn(3, generator=g).to(torch.bfloat16)), codes, scale,
            ("b.bias", torch.randn(7, generator=g)),
            ("c.fp8", torch.randn(3, 3, generator=g).to(torch.float8_e4m3fn))]


def test_pack_unpack_round_trip_is_bit_exact_and_aligned():
    named = align_order(_mixed())
    layout = layout_of(named)
    # itemsize non-increasing => every offset divisible by its itemsize (SGLang refuses otherwise)
    sizes = [t.element_size() for _, t in named]
    assert sizes == sorted(sizes, reverse=True)
    for spec, (_, t) in zip(layout.specs, named):
        assert spec.offset % t.element_size() == 0
    assert layout.nbytes == sum(t.numel() * t.element_size() for _, t in named)
    buf = pack(named, layout)
    assert buf.dtype == torch.uint8 and buf.numel() == layout.nbytes
    for (n1, a), (n2, b) in zip(named, unpack(buf.clone(), layout)):
        assert n1 == n2 and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_from_meta_rejects_bad_metadata():
    with pytest.raises(ValueError, match="not aligned"):  # int8 (1 byte) then fp32 at offset 3
        BucketLayout.from_meta(["x", "y"], ["int8", "float32"], [[3], [2]])
    with pytest.raises(ValueError, match="unknown dtype"):
        BucketLayout.from_meta(["x"], ["torch.int8"], [[3]])
    with pytest.raises(ValueError, match="bad shape"):
        BucketLayout.from_meta(["x"], ["int8"], [[-1]])
    with pytest.raises(ValueError, match="must be equal"):
        BucketLayout.from_meta(["x", "y"], ["int8"], [[1]])
    with pytest.raises(ValueError, match="listed twice"):
        BucketLayout.from_meta(["x", "x"], ["int8", "int8"], [[1], [1]])


def test_buckets_respect_budget_and_keep_codes_with_scales():
    g = torch.Generator().manual_seed(1)
    chunks = []
    for i in range(5):
        w = torch.randn(16, 32, generator=g)
        chunks += list(quantize_named([(f"model.layers.{i}.self_attn.q_proj.weight", w)], "int8"))
    chunks.append(("model.embed_tokens.weight", torch.randn(64, 32, generator=g)))  # 8 KiB alone
    assert [len(grp) for grp in group_pairs(chunks)] == [2] * 5 + [1]
    budget = 1200  # one int8 q_proj = 512 B codes + 64 B scale = 576 B -> two per bucket
    buckets = list(plan_buckets(iter(chunks), budget))
    names = [b.layout.names for b in buckets]
    assert len(buckets) == 4
    for b in buckets[:-1]:
        assert b.layout.nbytes <= budget
        for n in b.layout.names:  # a code tensor's scale is in the same bucket
            if not n.endswith("_scale"):
                assert n + "_scale" in b.layout.names or "embed" in n
    assert names[-1] == ["model.embed_tokens.weight"]  # oversized group: a bucket of its own
    sent = sorted(n for b in buckets for n in b.layout.names)
    assert sent == sorted(n for n, _ in chunks)


def _qwen_like(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [("model.embed_tokens.weight", torch.randn(40, 16, generator=g))]
    for i in range(2):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", torch.randn(16, generator=g)),
                (p + "self_attn.q_proj.weight", torch.randn(16, 16, generator=g)),
                (p + "self_attn.q_proj.bias", torch.randn(16, generator=g)),
                (p + "mlp.down_proj.weight", torch.randn(16, 48, generator=g))]
    return out


@pytest.mark.parametrize("fmt,wire", [("int8", None), ("fp8", None), ("fp8_block", None),
                                      ("bf16", None), ("int8", torch.bfloat16),
                                      ("fp8_block", torch.float16), ("bf16", torch.bfloat16)])
def test_arena_quantizer_matches_quantize_named_and_keeps_the_previous_version(fmt, wire):
    """Exactly quantize_named's chunks (wire=None) or engine_chunks' with that wire dtype: what
    passes through cast (one rounding from fp32), codes and fp32 scales untouched."""
    quantizer = ArenaQuantizer(fmt, budget_bytes=1200, wire_dtype=wire)  # several buckets
    previous = None
    for version in range(4):  # versions 0, 1 lay the arenas out; 2, 3 are written in place
        weights = _qwen_like(version)
        chunks, _, _ = quantizer.quantize(iter(weights))
        want = list(quantize_named(weights, fmt)) if wire is None else \
            list(engine_chunks(weights, fmt, wire_dtype=wire))
        if wire is not None:
            assert {t.dtype for n, t in want if "embed" in n or "norm" in n} == {wire}
        assert [n for n, _ in chunks] == [n for n, _ in want]
        for (n, got), (_, ref) in zip(chunks, want):  # exactly quantize_named's codes and scales
            assert got.dtype == ref.dtype and torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), n
        # every bucket of this version is already in place: the Sender broadcasts it unpacked
        buckets = list(plan_buckets(chunks, 1200))
        assert len(buckets) > 2 and all(bucket_buffer(b.tensors, b.layout) is not None for b in buckets)
        if previous is not None:  # the version before is still intact (the flip tracker reads it)
            prev_chunks, prev_want = previous
            for (n, got), (_, ref) in zip(prev_chunks, prev_want):
                assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), n
        previous = (chunks, want)


def test_bucket_buffer_only_for_tensors_in_place_and_arena_refuses_a_new_layout():
    weights = _qwen_like(0)
    chunks = list(quantize_named(weights, "int8"))
    bucket = next(plan_buckets(chunks, 3000))
    assert bucket_buffer(bucket.tensors, bucket.layout) is None  # separate tensors: must pack
    arena = ChunkArena(chunks, 3000)
    placed = [(n, arena.views[n].copy_(t)) for n, t in chunks]
    bucket = next(plan_buckets(placed, 3000))
    buf = bucket_buffer(bucket.tensors, bucket.layout)
    assert buf is not None and torch.equal(buf, pack(bucket.tensors, bucket.layout))
    shifted = list(bucket.tensors)
    shifted[0], shifted[1] = shifted[1], shifted[0]  # same tensors, not at their layout offsets
    assert bucket_buffer(shifted, layout_of(shifted)) is None
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight"):
        arena.fill([(n, t[:8] if "q_proj.weight" in n else t) for n, t in weights], "int8", [0.0, 0.0])
    with pytest.raises(ValueError, match="names or order changed"):
        arena.fill(weights[:-1], "int8", [0.0, 0.0])
    nan = [(n, t.clone()) for n, t in weights]
    nan[2][1][3, 5] = float("nan")
    with pytest.raises(ValueError, match="q_proj.weight: w contains NaN"):
        arena.fill(nan, "int8", [0.0, 0.0])


def test_engine_chunks_formats():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(130, 260, generator=g)
    norm = torch.randn(260, generator=g)
    named = [("model.layers.0.mlp.gate_proj.weight", w), ("model.norm.weight", norm)]
    int8 = dict(engine_chunks(named, "int8"))
    ref = dict(quantize_named(named, "int8"))
    assert int8.keys() == ref.keys() and all(torch.equal(int8[k], ref[k]) for k in ref)
    blk = dict(engine_chunks(named, "fp8_block"))
    codes, scale = quantize_fp8_block(w, 128)
    assert blk["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 3)
    assert torch.equal(blk["model.layers.0.mlp.gate_proj.weight_scale_inv"], scale)
    assert torch.equal(blk["model.layers.0.mlp.gate_proj.weight"].view(torch.uint8),
                       codes.view(torch.uint8))
    err = (dequantize_fp8_block(codes, scale, 128) - w).abs().max()
    assert err <= w.abs().max() * 2 ** -4  # E4M3 keeps 3 mantissa bits
    bf = dict(engine_chunks(named, "bf16"))
    assert all(t.dtype == torch.bfloat16 for t in bf.values())
    wire = dict(engine_chunks(named, "int8", wire_dtype=torch.bfloat16))
    assert wire["model.norm.weight"].dtype == torch.bfloat16
    assert wire["model.layers.0.mlp.gate_proj.weight_scale"].dtype == torch.float32  # never cast
    with pytest.raises(ValueError, match="fmt"):
        list(engine_chunks(named, "int4"))


def test_engine_wire_dtype_follows_the_engine(tmp_path):
    """Local engine: the masters' fp32 (None). SGLang: --dtype from sglang_args, else SGLang's
    auto rule on the checkpoint (its dtype; fp32 -> fp16, bf16 for Gemma); bad values refused."""
    import json
    from dataclasses import replace

    from qurl.config import load_config
    from qurl.engines.factory import engine_wire_dtype

    def wire(meta: dict, *args: str):
        (tmp_path / "config.json").write_text(json.dumps(meta))
        cfg = load_config(sets=["rollout.engine=sglang", "sglang.urls=http://h:1"])
        cfg = replace(cfg, sglang=replace(cfg.sglang, args=tuple(args)))
        return engine_wire_dtype(cfg.rollout, cfg.sglang, tmp_path)

    local = load_config()
    assert engine_wire_dtype(local.rollout, local.sglang, tmp_path / "absent") is None  # never reads
    assert wire({"dtype": "bfloat16"}) == torch.bfloat16
    assert wire({"torch_dtype": "float16"}) == torch.float16
    assert wire({"dtype": "float32", "model_type": "qwen2"}) == torch.float16
    assert wire({"model_type": "gemma2"}) == torch.bfloat16
    assert wire({"dtype": "float32"}, "--tp", "2", "--dtype", "bfloat16") == torch.bfloat16
    assert wire({"dtype": "bfloat16"}, "--dtype=half") == torch.float16
    assert wire({"dtype": "bfloat16"}, "--dtype", "float32") == torch.float32
    with pytest.raises(ValueError, match="--dtype 'int4'"):
        wire({}, "--dtype", "int4")
    # servers qurl launches load its bf16 export, whatever the base model's dtype
    launched = load_config(sets=["rollout.engine=sglang"])
    assert engine_wire_dtype(launched.rollout, launched.sglang, tmp_path / "absent") == torch.bfloat16
    fp16 = replace(launched.sglang, args=("--dtype", "float16"))
    assert engine_wire_dtype(launched.rollout, fp16, tmp_path / "absent") == torch.float16


def test_announcement_round_trip_and_validation():
    named = align_order(_mixed())
    ann = BucketAnnouncement(3, 1, True, "flattened_bucket", layout_of(named))
    back = BucketAnnouncement.from_dict(ann.to_dict())
    assert back == ann
    bad = ann.to_dict() | {"version": "3"}
    with pytest.raises(ValueError, match="'version'"):
        BucketAnnouncement.from_dict(bad)
    with pytest.raises(ValueError, match="load_format"):
        BucketAnnouncement.from_dict(ann.to_dict() | {"load_format": "zip"})


def test_weight_group_refuses_nccl_without_cuda_before_rendezvous():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    # a ValueError, not the rendezvous timeout (RuntimeError) after waiting for the other rank
    with pytest.raises(ValueError, match="'nccl' needs a CUDA device"):
        WeightGroup("127.0.0.1", free_port(), rank=0, world_size=2, backend="nccl", timeout_s=30)


# ---------------------------------------------------------------- real two-process sync

def _receiver_main(model_dir, port, ann_q, out_q, syncs, out_dir):
    from qurl.engines.local import LocalEngine
    from qurl.weights.receiver import WeightReceiver

    try:
        engine = LocalEngine(model_dir, precision="int8")
        group = WeightGroup("127.0.0.1", port, rank=1, world_size=2, timeout_s=60)
        rec = WeightReceiver(group, engine)
        for _ in range(syncs):
            try:
                stats = rec.receive(lambda: ann_q.get(timeout=60))
            except ValueError as e:  # the engine refused a chunk: report, stay in the group
                path = f"{out_dir}/refused_v{engine.version}.pt"
                torch.save({n: t.detach().clone() for n, t in engine._tensors.items()}, path)
                out_q.put(("refused", str(e), engine.version, None, path))
                continue
            path = f"{out_dir}/state_v{engine.version}.pt"  # tensors via a file, not the queue
            torch.save({n: t.detach().clone() for n, t in engine._tensors.items()}, path)
            out_q.put(("ok", stats.versions_seen, engine.version, stats.buckets, path,
                       engine.adopted))
        group.close()
    except Exception as e:  # report instead of dying silently: the test would wait for nothing
        out_q.put(("error", repr(e), None, None, None))


@pytest.mark.slow
def test_two_process_sync_into_local_engine(tmp_path):
    from qurl.models.hf import build_model, read_state_dict

    model_dir = build_model(tmp_path / "m", "tiny", seed=0)
    g = torch.Generator().manual_seed(5)
    learner = {n: t + 0.01 * torch.randn(t.shape, generator=g)
               for n, t in read_state_dict(model_dir).items()}
    ctx = mp.get_context("spawn")
    ann_q, out_q = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_receiver_main, args=(str(model_dir), port, ann_q, out_q, 6, str(tmp_path)))
    proc.start()
    try:
        group = WeightGroup("127.0.0.1", port, rank=0, world_size=2, timeout_s=60)
        expected = dict(quantize_named(learner, "int8"))
        # an unknown tensor at the end of the fourth sync: the engine refuses that sync (version
        # and weights unchanged), the receiver still joins every broadcast, and the next sync
        # goes through. LocalEngine adopts the receive buffers (two banks): the refused sync, with
        # other values in the same bucket layout, must land in the bank the engine does not hold.
        bad = {**{n: t * 2 for n, t in learner.items()}, "model.bogus.weight": torch.ones(4)}
        half = {n: t * 0.5 for n, t in learner.items()}
        # round 6: chunks quantized into wire buckets (the pipeline's path) go out unpacked
        quantizer = ArenaQuantizer("int8", 256 << 10)
        for k in range(3):  # the third version is the first written into a reused arena
            arena_chunks = quantizer.quantize({n: t * (1 + k) for n, t in learner.items()}.items())[0]
        rounds = ((1, "flattened_bucket", learner, learner), (2, "per_tensor", half, half),
                  (3, "flattened_bucket", learner, learner), (4, "flattened_bucket", bad, learner),
                  (4, "flattened_bucket", half, half),
                  (5, "flattened_bucket", arena_chunks, {n: t * 3 for n, t in learner.items()}))
        for version, load_format, weights, want in rounds:
            arena = version == 5
            sender = WeightSender(group, bucket_bytes=256 << 10, load_format=load_format)
            stats = sender.send(weights if arena else engine_chunks(weights.items(), "int8"),
                                version,
                                announce=lambda a: ann_q.put(a.to_dict()))
            assert stats.packed == (0 if arena or load_format == "per_tensor" else stats.buckets)
            expected = dict(quantize_named(want, "int8"))
            try:
                status, seen, engine_version, nbuckets, path, *adopted = out_q.get(timeout=120)
            except queue.Empty:
                pytest.fail("receiver process did not report")
            state = torch.load(path)
            for name, t in expected.items():  # exact: same codes, same scales, same fp32 tensors
                assert torch.equal(state[name].view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                                   else state[name], t), (version, name)
            if weights is bad:
                assert status == "refused" and "model.bogus.weight" in seen
                assert engine_version == 3
                continue
            assert status == "ok", seen
            assert adopted == [True]  # every sync covers the model: taken without a copy
            assert nbuckets == stats.buckets > 2
            assert stats.bytes == sum(t.numel() * t.element_size() for t in expected.values())
            # the version moves only after the last bucket
            old = 3 if version == 4 else version - 1
            assert seen == [old] * (nbuckets + 1) and engine_version == version
        group.close()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
