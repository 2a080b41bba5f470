"""20 delta syncs of a REAL training run into the REAL SGLang 0.5.23 server on CPU (`make test-sglang`).

A module fixture runs a short qurl training run (20 RL steps, local int8 engine, tiny model) from
the same tiny Qwen2 the servers load (4 heads of 64, warm-started briefly so some samples are
right and steps have gradients), and captures, through a spy on `WeightSync.push`, the 21
full-precision weight versions its learner published (the initial weights and one per step).

Those versions then drive qurl's production sync loop (`WeightSync.push`: quantize, plan delta vs
full, load, verify, resync on mismatch) into a real server launched by qurl's `SGLangEngine` (with
qurl's sync loader, qurl/engines/sglang/inside/apply.py, imported by the server from this checkout:
tests/sglang_real.py puts the repository first on the servers' PYTHONPATH). For each 8-bit format
SGLang serves — w8a8_int8, w8a8_fp8 (per channel) and block fp8 — the first version goes in full
and the 20 after it as deltas, each verified by the server; afterwards every parameter the server
holds is byte-equal to the learner's codes, scales and bf16 tensors and to a full sync of the
same version, at the address it had at startup; one code corrupted on the server on purpose is
caught by the next sync's verification and repaired by the full resync, counted in the metrics.
"""
from __future__ import annotations

import math

import pytest
import torch

from qurl.engines.sglang.inside.loader import LOAD_FORMAT as RESTORE
from qurl.engines.sglang.protocol import QUANTIZATION
from qurl.models.export8bit import export_8bit
from qurl.quant.named import engine_chunks
from qurl.weights.publish import WeightSync
from tests.sglang_real import (  # noqa: F401
    CORRUPT,
    NO_TENSORS,
    env,
    fuse_like_sglang,
    held_like,
    is_8bit,
    launch,
    models,
    needs_sglang,
    push_versions,
    raw_bytes,
    read_back_with_ptrs,
)

pytestmark = needs_sglang + [pytest.mark.timeout(3600)]
STEPS = 20  # training steps: 21 versions, the first synced in full, then 20 deltas
# the twenty-step run of tests/test_delta_sync.py: 2 prompts x 4 samples of 16 tokens, default lr
SMALL = {"rollout.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 16,
         "optim.lr": 3e-5, "deploy.ckpt_every": 0, "data.train_size": 40}


def _warm_start(src, out, cfg):
    """`src` fine-tuned like qurl's own tiny base (qurl/models/base.py: build_base) on worked
    solutions of the run's task: RL from a random model sees reward 0 everywhere, no gradient."""
    from qurl.data.synthetic import arithmetic_task, worked_solution
    from qurl.data.templates import render_prompt
    from qurl.models.base import WARMSTART_QUESTIONS
    from qurl.models.tokenizer import build_tokenizer
    from qurl.models.warmstart import sft_warmstart

    tok, d = build_tokenizer(), cfg.data
    task = arithmetic_task(WARMSTART_QUESTIONS, seed=cfg.run.seed, split="train", digits=d.digits,
                           n_operands=d.operands, at_most=True)
    pairs = [(render_prompt(ex.prompt, d.template, tokenizer=tok), worked_solution(ex))
             for ex in task]
    return sft_warmstart(src, pairs, steps=cfg.model.warmstart_steps, lr=cfg.model.warmstart_lr,
                         batch_size=32, seed=cfg.run.seed, out_dir=out, num_threads=1)


@pytest.fixture(scope="module")
def run(models, tmp_path_factory):
    """(the model dir the run started from, its 21 published versions, its train records)."""
    from qurl.learner.dist import free_port
    from qurl.commands.train import train
    from qurl.train.metrics_log import read_metrics
    from tests.pipeline_helpers import tiny_cfg

    root, src, _, _ = models
    runs = tmp_path_factory.mktemp("run")
    base = _warm_start(src, root / "warm", tiny_cfg(runs, "run", STEPS, **SMALL))
    captured: list[dict[str, torch.Tensor]] = []
    push = WeightSync.push

    def spy(self, named, engine, version):
        if self.precision != "int8":  # an evaluation engine's own pushes, not the policy's
            return push(self, named, engine, version)
        named = [(n, t.detach().clone()) for n, t in named]
        captured.append(dict(named))
        return push(self, iter(named), engine, version)

    with pytest.MonkeyPatch.context() as mp:
        # this in-process run's rendezvous port, for it only: the `qurl train` processes of later
        # tests must not inherit it (this process's store may still listen there: EADDRINUSE)
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        mp.setattr(WeightSync, "push", spy)
        train(tiny_cfg(runs, "run", STEPS, **SMALL, **{"model.base": str(base)}))
    recs = [r for r in read_metrics(runs / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(captured) == STEPS + 1 and [r["step"] for r in recs] == list(range(1, STEPS + 1))
    # the run trained: some step had a gradient, some sync flipped codes
    assert any(r["grad_norm"] > 0 for r in recs), [r["grad_norm"] for r in recs]
    assert any(r["flip_frac"] > 0 for r in recs), [r["flip_frac"] for r in recs]
    return base, captured, recs


def _corrupt(eng, dump) -> str:
    """Flip one code on the server behind qurl's back (test loader, inside a session)."""
    s = eng.servers[0]
    body = {"serialized_named_tensors": [NO_TENSORS], "flush_cache": False}
    s.post_json("/begin_weight_update", {}, 30)
    try:
        if RESTORE in s.spec.command:  # W8A8: restore first, or closing transposes twice
            s.post_json("/update_weights_from_tensor", {**body, "load_format": RESTORE}, 30)
        s.post_json("/update_weights_from_tensor", {**body, "load_format": CORRUPT}, 30)
    finally:
        s.post_json("/end_weight_update", {}, 30)
    return (dump / "corrupted.txt").read_text()


@pytest.mark.parametrize("precision", ["int8", "fp8", "fp8_block"])
def test_twenty_delta_syncs_of_a_run_verified_byte_equal_and_corruption_caught(
        precision, env, models, run, tmp_path_factory):
    quant, fmt = QUANTIZATION[precision]
    root = models[0]
    base, versions, _ = run
    last = versions[-1]
    ckpt0 = export_8bit(base, root / f"{fmt}_v0", fmt)
    eng = launch(ckpt0, quant, tmp_path_factory.mktemp(f"logs_delta_{precision}"),
                 precision=precision, generates=False)
    try:
        assert eng.can_verify, "the server should run qurl's sync loader"
        held0, ptrs0 = read_back_with_ptrs(eng, env)
        sync = WeightSync(fmt, bucket_bytes=1 << 20, wire_dtype=torch.bfloat16)
        recs = push_versions(sync, eng, versions)
        held_d, ptrs_d = read_back_with_ptrs(eng, env)
        # one code corrupted on the server. The next sync re-sends the same weights: a delta of
        # nothing (a changed tensor could be re-sent whole and repair the code by chance: block
        # FP8 re-sends a tensor whose tile scales moved), so only verification can see it
        corrupted = _corrupt(eng, env)
        bad = sync.push(iter(last.items()), eng, version=len(versions) + 1)
        held_r, ptrs_r = read_back_with_ptrs(eng, env)
        # the same version again, in full (a fresh sync that does not build on anything)
        full = WeightSync(fmt, bucket_bytes=1 << 20, wire_dtype=torch.bfloat16, mode="full")
        rec_full = full.push(iter(last.items()), eng, version=len(versions) + 2)
        held_f, ptrs_f = read_back_with_ptrs(eng, env)
    finally:
        eng.close()
    for k, r in enumerate(recs, start=1):
        print(f"{precision} v{k}: delta={r['sync/delta']:.0f} bytes={r['sync/bytes']:.0f} "
              f"full_bytes={r['sync/full_bytes']:.0f} verified={r['sync/verified']} "
              f"load_s={r['sync/time_load']:.3f} verify_s={r['sync/time_verify']:.3f} "
              f"wall_s={r['wall_s']:.3f} flip_frac={r.get('flip_frac', float('nan')):.5f}")
    print(f"{precision} full sync of v{len(versions)}: bytes={rec_full['sync/bytes']:.0f} "
          f"load_s={rec_full['sync/time_load']:.3f} verify_s={rec_full['sync/time_verify']:.3f}")
    # the first sync is full (nothing to diff against), every later one a verified delta that
    # sends less than the whole version (a real run's step flips few codes: bf16 tensors that
    # changed go whole, 8-bit ones as their flipped codes)
    assert recs[0]["sync/delta"] == 0.0 and recs[0]["sync/full_reason/first"] == 1.0
    assert all(r["sync/verified"] == 1.0 for r in recs)
    assert len(recs) == STEPS + 1
    for r in recs[1:]:
        assert r["sync/delta"] == 1.0, r
        assert "sync/full_reason/unsupported" not in r
        assert 0 < r["sync/bytes"] < r["sync/full_bytes"], r
        assert r["sync/verify_mismatches"] == 0.0
    # the run moved the 8-bit grid: some sync flipped codes of this format
    assert any(r["flip_frac"] > 0 for r in recs[1:]), [r["flip_frac"] for r in recs]
    # the corrupted code: caught (a mismatch in exactly the tensor holding it), resynced in full,
    # counted; the engine then verifies
    assert corrupted.endswith("self_attn.qkv_proj.weight"), corrupted
    layer = corrupted.rsplit(".self_attn", 1)[0]
    assert bad["sync/delta"] == 1.0 and bad["sync/verified"] == 0.0
    assert bad["sync/verify_mismatches"] == 1.0  # one tensor: the corrupted q_proj
    assert bad["sync/resync/mismatch"] == 1.0 and bad["sync/fallbacks/mismatch"] == 1.0
    assert bad["sync/bytes"] == bad["sync/full_bytes"]  # an empty delta, then the whole version
    assert eng.digest is not None and layer.startswith("model.layers.")
    assert rec_full["sync/verified"] == 1.0 and rec_full["sync/full_reason/off"] == 1.0
    # byte-equal: after the deltas, to the learner's chunks; after the repair, to a full sync
    expected = fuse_like_sglang(list(engine_chunks(last.items(), fmt, wire_dtype=torch.bfloat16)))
    for held in (held_d, held_r):
        assert set(expected) <= set(held), sorted(set(expected) - set(held))
        for name, want in expected.items():
            got = held_like(held[name], want)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(raw_bytes(got), raw_bytes(want)), name
            # rows a padded vocabulary adds are never written
            if got.shape != held[name].shape:
                n = want.shape[0]
                assert torch.equal(raw_bytes(held[name][n:]), raw_bytes(held0[name][n:])), name
        for name in set(held) - set(expected):  # what qurl never sends is untouched
            assert torch.equal(raw_bytes(held[name]), raw_bytes(held0[name])), name
    assert set(held_f) == set(held_r)
    for name, t in held_f.items():
        assert torch.equal(raw_bytes(t), raw_bytes(held_r[name])), name
    # every parameter at its startup address (what captured CUDA graphs read)
    assert sum(is_8bit(t) for t in held0.values()) >= 4, sorted(held0)
    for what, ptrs in (("deltas", ptrs_d), ("repair", ptrs_r), ("full", ptrs_f)):
        moved = sorted(n for n in ptrs0 if ptrs[n] != ptrs0[n])
        assert not moved, f"after the {what}, new storage for: {moved}"
    assert math.isfinite(recs[-1]["sync/time_verify"])
