"""What the kernels read, and syncs that change nothing, on a REAL SGLang 0.5.23 server on CPU.

1. The post-repack read-back (qurl/engines/sglang/inside/readback.py). qurl's in-session check
   hashes the weights inside the verification session, in the restored loading layout; the
   session then closes with SGLang's repack (`process_weights_after_loading`), and generation
   reads what that produced. A test loader (tests/sglang_cpu/qurl_sglang_dump.py
   `corrupt_next_verified_repack`) makes that closing repack flip one bit of the repacked
   q_proj weight, once: the in-session check has already passed, so only the read-back of the
   kernels' tensors, in a session of its own after the repack, can see it. The sync must count a
   mismatch, resync in full and leave the server holding the learner's codes.
2. Idempotence (issue 60 item 1): the same weights synced three times, as deltas and then as full
   syncs, leave every parameter of every TP rank bit-identical at its startup address, each sync
   verified in session and read back after the repack. TP 1 for w8a8_int8 / w8a8_fp8, TP 2 for
   w8a8_int8 (two scheduler processes on this CPU).
"""
from __future__ import annotations

import pytest
import torch

from qurl.engines.sglang.inside.loader import LOAD_FORMAT as RESTORE
from qurl.engines.sglang.protocol import NO_TENSORS, QUANTIZATION
from qurl.models.export8bit import export_8bit
from qurl.models.hf import build_model, read_state_dict
from qurl.quant.named import engine_chunks
from qurl.weights.publish import WeightSync
from tests.sglang_real import (  # noqa: F401
    BREAK_REPACK,
    env,
    launch,
    models,
    needs_sglang,
    raw_bytes,
    read_back_ranks,
)

pytestmark = needs_sglang + [pytest.mark.timeout(900)]


def _install_broken_repack(eng, dump) -> None:
    s = eng.servers[0]
    body = {"serialized_named_tensors": [NO_TENSORS] * s.spec.tp, "flush_cache": False}
    s.post_json("/begin_weight_update", {}, 30)
    try:
        s.post_json("/update_weights_from_tensor", {**body, "load_format": BREAK_REPACK}, 30)
        s.post_json("/update_weights_from_tensor", {**body, "load_format": RESTORE}, 30)
    finally:
        s.post_json("/end_weight_update", {}, 30)
    assert not (dump / "corrupted.txt").exists(), "fired in the test's own session"


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_corrupting_repack_after_the_in_session_check_is_caught_by_the_read_back(
        precision, env, models, tmp_path):
    root, src, v0, _ = models
    quant, fmt = QUANTIZATION[precision]
    (env / "corrupted.txt").unlink(missing_ok=True)
    eng = launch(export_8bit(src, tmp_path / fmt, fmt), quant, tmp_path / "logs",
                 precision=precision, generates=False)
    try:
        assert eng.can_read_kernels, [s.custom_loaders for s in eng.servers]
        eng.verify_kernels_every = 1
        sync = WeightSync(fmt, bucket_bytes=1 << 20, wire_dtype=torch.bfloat16)
        first = sync.push(iter(v0.items()), eng, version=1)
        checks_1 = eng.kernel_checks
        _install_broken_repack(eng, env)
        rec = sync.push(iter(v0.items()), eng, version=2)  # the same weights: a delta of nothing
        corrupted = (env / "corrupted.txt").read_text()
        (held, _), = read_back_ranks(eng, env)
    finally:
        eng.close()
    print(f"{precision}: v2 {({k: v for k, v in rec.items() if 'verif' in k or 'resync' in k})}")
    assert first["sync/verified"] == 1.0 and checks_1 == 1
    assert corrupted == "model.layers.0.self_attn.q_proj.weight"
    # caught after the repack, although the in-session check passed; resynced in full
    assert rec["sync/delta"] == 1.0 and rec["sync/verified"] == 0.0, rec
    assert rec["sync/verify_mismatches"] == 1.0 and rec["sync/resync/mismatch"] == 1.0, rec
    want = dict(engine_chunks(v0.items(), fmt, wire_dtype=torch.bfloat16))
    q = want["model.layers.0.self_attn.q_proj.weight"]
    qkv = held["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(raw_bytes(qkv[:q.shape[0]]), raw_bytes(q))  # the server holds it right


def _three_times(eng, env, chunks_of: dict, mode: str, first_version: int):
    sync = WeightSync(QUANTIZATION[eng.precision][1], bucket_bytes=1 << 20,
                      wire_dtype=torch.bfloat16, mode=mode)
    out = []
    for k in range(3):
        rec = sync.push(iter(chunks_of.items()), eng, version=first_version + k)
        out.append((rec, read_back_ranks(eng, env)))
    return out


@pytest.mark.parametrize("precision,tp", [("int8", 1), ("fp8", 1), ("int8", 2)])
def test_three_identical_syncs_leave_every_bit_in_place(precision, tp, env, tmp_path):
    quant, fmt = QUANTIZATION[precision]
    src = build_model(tmp_path / "v0", "tiny", seed=0,
                      overrides={"num_attention_heads": 4, "num_key_value_heads": 2})
    g = torch.Generator().manual_seed(3)
    v1 = {k: t + 1e-2 * torch.randn(t.shape, generator=g) * t.float().std()
          for k, t in read_state_dict(src).items()}  # not the checkpoint the server started from
    eng = launch(export_8bit(src, tmp_path / fmt, fmt), quant, tmp_path / "logs",
                 precision=precision, generates=False, tp=tp)
    try:
        eng.verify_kernels_every = 1
        start = read_back_ranks(eng, env)
        runs = _three_times(eng, env, v1, "delta", 1) + _three_times(eng, env, v1, "full", 4)
        checks = eng.kernel_checks
    finally:
        eng.close()
    assert checks == 6, checks  # every sync read back after its repack
    recs = [r for r, _ in runs]
    assert [r["sync/delta"] for r in recs] == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert all(r["sync/verified"] == 1.0 and r["sync/verify_mismatches"] == 0.0 for r in recs)
    assert all(r["sync/bytes"] < 0.01 * r["sync/full_bytes"] for r in recs[1:3]), recs[1:3]
    ref = runs[0][1]
    assert len(ref) == tp
    for rank in range(tp):
        held0, ptrs0 = ref[rank]
        moved = [n for n, t in held0.items()
                 if not torch.equal(raw_bytes(t), raw_bytes(start[rank][0][n]))]
        assert moved, "v1 changed nothing: the check would be vacuous"
        for k, (_, ranks) in enumerate(runs[1:], start=2):
            held, ptrs = ranks[rank]
            assert set(held) == set(held0)
            diff = [n for n in held0 if not torch.equal(raw_bytes(held[n]), raw_bytes(held0[n]))]
            assert not diff, (rank, k, diff)
            assert ptrs == ptrs0 == start[rank][1], (rank, k)
