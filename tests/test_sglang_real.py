"""qurl's SGLang adapter against the REAL SGLang 0.5.23 server on CPU (`make test-sglang`).

Each flow here runs real `python -m sglang.launch_server` processes from `.venv-sglang` (see
tests/sglang_real.py for how, and what CPU servers can and cannot do) and drives them with qurl's
production code: `SGLangEngine` (launch, /generate parsing, pause/continue, begin/end sessions,
gloo weight group, recovery) and `WeightSync` (the learner's quantize-into-arena + broadcast path).
Skipped, with the reason, when `.venv-sglang` is absent (plain `make test`, CI).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from qurl.engines.local import LocalEngine
from qurl.engines.sglang.engine import SGLangEngine
from qurl.engines.sglang.launcher import ServerSpec
from qurl.engines.sglang.protocol import QUANTIZATION, RESTORE_QUANTIZATIONS, SGLangError
from qurl.models.export8bit import export_8bit
from qurl.quant.named import engine_chunks
from qurl.weights.publish import WeightSync
from qurl.types import GenRequest, SamplingParams
from tests.sglang_real import (  # noqa: F401
    TIMEOUTS,
    checksums,
    env,
    fuse_like_sglang,
    held_like,
    is_8bit,
    launch,
    models,
    needs_sglang,
    raw_bytes,
    read_back,
    read_back_with_ptrs,
    run_leaving_no_server,
    write_model,
)

# a real server takes ~20 s to start on a quiet 2-core machine, minutes on a loaded one
pytestmark = needs_sglang + [pytest.mark.timeout(1800)]

# bf16 server (bf16 weights and activations) vs the local engine computing in fp32 on the same
# bf16-rounded weights: measured max |Δ logprob| ~0.02 on this model; the bound leaves 2.5x room
LOGPROB_TOL, BATCH_TOL = 0.05, 1e-3  # v1 vs local engine; same weights, another batching


@pytest.fixture(scope="module")
def bf16_server(env, models, tmp_path_factory):
    root, src, v0, _ = models
    ckpt = export_8bit(src, root / "bf16_v0", "bf16")
    eng = launch(ckpt, None, tmp_path_factory.mktemp("logs"), precision="bf16", generates=True,
                 vocab_size=100)
    yield eng, ckpt
    eng.close()


def _req(rid: str, prompt: list[int], n: int, *, temperature: float = 0.0, seed: int | None = None,
         stop: tuple[int, ...] = ()) -> GenRequest:
    return GenRequest(rid=rid, prompt_ids=prompt,
                      params=SamplingParams(max_new_tokens=n, temperature=temperature, top_p=1.0,
                                            seed=seed, stop_token_ids=stop))


PROMPTS = [[5, 17, 23, 42, 8], [60, 2, 2, 71], [33, 34, 35, 36, 37, 38, 39]]


def _local_logprobs(model_dir: Path, results) -> list[torch.Tensor]:
    ref = LocalEngine(model_dir, precision="bf16", dtype=torch.float32)
    return [ref.logprobs(r.prompt_ids, r.output_ids.tolist()) for r in results]


def _max_dev(results, ref) -> float:
    return max(float((r.logprobs - x).abs().max()) for r, x in zip(results, ref))


# ------------------------------------------------------------------------------------ bf16 flows
def test_bf16_generate_logprobs_match_local_engine(bf16_server):
    eng, ckpt = bf16_server
    res = eng.generate([_req(f"g{i}", p, 24) for i, p in enumerate(PROMPTS)])
    assert all(len(r.output_ids) > 0 for r in res)
    dev = _max_dev(res, _local_logprobs(ckpt, res))
    print(f"bf16 server vs local engine: max |dlogprob| = {dev:.4f} (tolerance {LOGPROB_TOL})")
    assert dev < LOGPROB_TOL
    assert all(int(v) == 0 for r in res for v in r.versions)


def test_top_logprobs_give_the_behaviour_entropy(bf16_server):
    """sglang.top_logprobs = k: each result carries, per token, the entropy bound from the
    server's top k (protocol.py topk_entropy). With k = the whole vocabulary (100) it is the
    entropy itself and matches the local engine's teacher-forced one on the same bf16 weights;
    with k = 3 it stays below it."""
    eng, ckpt = bf16_server
    ref = LocalEngine(ckpt, precision="bf16", dtype=torch.float32)
    try:
        for k in (100, 3):
            eng.top_logprobs = k
            res = eng.generate([_req(f"h{k}.{i}", p, 16, temperature=0.8) for i, p in enumerate(PROMPTS)])
            for r in res:
                z = ref.token_logits(r.prompt_ids, r.output_ids.tolist()).double() / 0.8
                exact = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
                assert r.entropy is not None and r.entropy.shape == exact.shape
                dev = (r.entropy.double() - exact)
                print(f"k={k}: server entropy - local: max {float(dev.max()):+.4f}, "
                      f"min {float(dev.min()):+.4f}, mean local {float(exact.mean()):.3f}")
                if k == 100:
                    assert float(dev.abs().max()) < LOGPROB_TOL
                else:
                    assert float(dev.max()) < LOGPROB_TOL and float(dev.mean()) < 0
    finally:
        eng.top_logprobs = 0
    (plain,) = eng.generate([_req("plain", PROMPTS[0], 4)])
    assert plain.entropy is None  # not asked: not reported


def test_stop_token_ends_generation_and_is_kept(bf16_server):
    eng, _ = bf16_server
    (free,) = eng.generate([_req("free", PROMPTS[0], 24)])
    ids = free.output_ids.tolist()
    stop = ids[5]
    first = ids.index(stop)
    (stopped,) = eng.generate([_req("stop", PROMPTS[0], 24, stop=(stop,))])
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids.tolist() == ids[:first + 1]  # the stop token is returned


def test_seeds_are_ignored_without_deterministic_inference(bf16_server):
    """SGLang 0.5.23 reads sampling_seed only under --enable-deterministic-inference, which needs
    an fa3/flashinfer/triton attention backend (GPU): on these servers the same seed gives
    different samples (README: what is reproducible with SGLang)."""
    eng, _ = bf16_server
    a, b = eng.generate([_req("s1", PROMPTS[1], 32, temperature=1.0, seed=7),
                         _req("s2", PROMPTS[1], 32, temperature=1.0, seed=7)])
    assert a.output_ids.tolist() != b.output_ids.tolist()


def test_pause_aborts_running_requests_and_health_waits(bf16_server):
    """pause(abort) returns running requests with their tokens so far; while paused /health
    blocks (a generation) but /model_info answers, which is what recovery probes."""
    eng, _ = bf16_server
    s = eng.servers[0]
    out: dict = {}

    def run() -> None:
        status, raw = s.call("POST", "/generate", {
            "rid": "long", "input_ids": PROMPTS[2], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}}, 120)
        out["status"], out["raw"] = status, raw

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    s.post_json("/pause_generation", {"mode": "abort"}, 30)
    t.join(60)
    import json

    reply = json.loads(out["raw"])
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(reply["output_ids"]) < 400
    assert s.alive(5.0)
    assert not s.healthy(3.0)  # /health is a generation: it waits behind the pause
    s.post_json("/continue_generation", {}, 30)
    assert s.healthy(30.0)


def test_abort_request_ends_one_request(bf16_server):
    eng, _ = bf16_server
    s = eng.servers[0]
    out: dict = {}

    def run() -> None:
        out["r"] = s.call("POST", "/generate", {
            "rid": "victim", "input_ids": PROMPTS[0], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}}, 120)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    s.call("POST", "/abort_request", {"rid": "victim"}, 30)
    t.join(60)
    import json

    reply = json.loads(out["r"][1])
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(reply["output_ids"]) < 400


def test_bf16_update_over_gloo_changes_generation(bf16_server, models):
    """A real begin / update_weights_from_distributed (gloo) / end session from qurl's engine:
    the served logprobs follow v1 within the bf16 tolerance, and sending v0 back restores the
    original logprobs exactly."""
    eng, ckpt = bf16_server
    root, src, v0, v1 = models
    reqs = [_req(f"u{i}", p, 16) for i, p in enumerate(PROMPTS)]
    before = eng.generate(reqs)
    eng.load_weights(engine_chunks(v1.items(), "bf16"), version=1)
    after = eng.generate(reqs)
    assert all(int(v) == 1 for r in after for v in r.versions)
    v1_dir = write_model(root, src, {k: t.to(torch.bfloat16) for k, t in v1.items()}, "bf16_v1")
    dev = _max_dev(after, _local_logprobs(v1_dir, after))
    print(f"after the v1 update: server vs local engine on v1: max |dlogprob| = {dev:.4f}")
    assert dev < LOGPROB_TOL
    assert _max_dev(after, _local_logprobs(ckpt, after)) > 4 * LOGPROB_TOL  # it did change
    eng.load_weights(engine_chunks(v0.items(), "bf16"), version=2)
    again = eng.generate(reqs)
    # same tokens; logprobs to BATCH_TOL: SGLang's CPU path is not batch-invariant and a loaded
    # machine may batch the requests differently (bytes of the weights: the read-back tests)
    for a, b in zip(before, again):
        assert a.output_ids.tolist() == b.output_ids.tolist()
        assert float((a.logprobs - b.logprobs).abs().max()) <= BATCH_TOL
    # the disk fallback reaches the same weights as the broadcast
    eng.update_weights_from_disk(str(v1_dir), version=3)
    disk = eng.generate(reqs)
    for a, b in zip(after, disk):
        assert a.output_ids.tolist() == b.output_ids.tolist()
        assert float((a.logprobs - b.logprobs).abs().max()) <= BATCH_TOL
        assert int(b.versions[0]) == 3


def test_w8a8_engine_refuses_a_server_without_the_restore_loader(bf16_server):
    """Attaching an int8 engine to a server launched without qurl's --custom-weight-loader fails
    at once with the flag to add (asking such a server for the restore would kill it), read
    from the real /server_info."""
    eng, _ = bf16_server
    with pytest.raises(SGLangError, match="without --custom-weight-loader"):
        SGLangEngine([ServerSpec(eng.servers[0].spec.url)], precision="int8", backend="gloo",
                     timeouts=TIMEOUTS)
    assert eng.servers[0].alive(5.0)


# ------------------------------------------------------------------------------- 8-bit updates
@pytest.mark.parametrize("precision", ["int8", "fp8", "fp8_block"])
def test_8bit_update_reads_back_byte_equal(precision, env, models, tmp_path_factory):
    """qurl's production sync (WeightSync: quantize into the wire arenas, broadcast 8-bit codes +
    scales over a real gloo group inside a begin/end session, with qurl's W8A8 restore) into a
    real server started from the v0 checkpoint. Afterwards every parameter it holds equals, byte
    for byte, (a) the learner's v1 codes and scales and bf16 tensors, fused as SGLang fuses them,
    and (b) what a server freshly started from the v1 checkpoint holds; and /weights_checker
    checksums agree with the fresh server's. Three updates (v1, v0, v1) keep every parameter —
    the 8-bit codes and their scales above all — at the address it had at startup (its
    `data_ptr`, what SGLang's captured CUDA graphs read), each reading back the version sent."""
    quant, fmt = QUANTIZATION[precision]
    root, src, v0, v1 = models
    logs = tmp_path_factory.mktemp(f"logs_{precision}")
    ckpt0 = export_8bit(src, root / f"{fmt}_v0", fmt)
    ckpt1 = export_8bit(write_model(root, src, v1, "fp32_v1"), root / f"{fmt}_v1", fmt)
    with ThreadPoolExecutor(2) as ex:  # both servers start at once: startup is most of the time
        futs = [ex.submit(launch, c, quant, logs, precision=precision, generates=False)
                for c in (ckpt0, ckpt1)]
        engines = [f.result() for f in futs]
    eng, fresh = engines
    try:
        held0, ptrs0 = read_back_with_ptrs(eng, env)
        sync = WeightSync(fmt, bucket_bytes=1 << 20, wire_dtype=torch.bfloat16)  # several buckets
        sync.push(iter(v1.items()), eng, version=1)
        (held1, ptrs1), sums1 = read_back_with_ptrs(eng, env), checksums(eng)
        sync.push(iter(v0.items()), eng, version=2)
        held2, ptrs2 = read_back_with_ptrs(eng, env)
        sync.push(iter(v1.items()), eng, version=3)
        held3, ptrs3 = read_back_with_ptrs(eng, env)
        held_fresh, sums_fresh = read_back(fresh, env), checksums(fresh)
        if quant in RESTORE_QUANTIZATIONS:
            # why qurl's restore exists: without it the same update is refused by the real server
            # (post-load repacking dropped the weight loaders)
            fresh.max_restarts = 0
            fresh._restore_w8a8 = fresh._prepare = lambda s: None  # (qurl's sync loader restores too)
            with pytest.raises(SGLangError, match="weight_loader"):
                fresh.load_weights(engine_chunks(v0.items(), fmt, wire_dtype=torch.bfloat16), 2)
    finally:
        for e in engines:
            e.close()
    # every parameter stayed where it was at startup, through 3 updates and 4 read-back sessions
    # (the server holds its 8-bit linears as such: qkv, o, gate_up, down of every layer)
    assert sum(is_8bit(t) for t in held0.values()) >= 4, sorted(held0)
    for k, ptrs in enumerate((ptrs1, ptrs2, ptrs3), start=1):
        moved = sorted(n for n in ptrs0 if ptrs[n] != ptrs0[n])
        assert not moved, f"after update {k}, new storage for: {moved}"
    # (a) the learner's codes and scales, byte for byte
    expected = fuse_like_sglang(list(engine_chunks(v1.items(), fmt, wire_dtype=torch.bfloat16)))
    assert set(expected) <= set(held1), sorted(set(expected) - set(held1))
    changed = 0
    for name, want in expected.items():
        got = held_like(held1[name], want)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(raw_bytes(got), raw_bytes(want)), name
        assert torch.equal(raw_bytes(held3[name]), raw_bytes(held1[name])), name  # v1 again
        changed += not torch.equal(raw_bytes(held_like(held0[name], want)), raw_bytes(got))
    assert changed == len(expected)  # every tensor really moved from v0
    v0_expected = fuse_like_sglang(list(engine_chunks(v0.items(), fmt, wire_dtype=torch.bfloat16)))
    for name, want in v0_expected.items():  # v0 sent back: the v0 codes, byte for byte
        assert torch.equal(raw_bytes(held_like(held2[name], want)), raw_bytes(want)), name
    # (b) a server started from the v1 checkpoint: every parameter, and the server's checksums
    assert set(held_fresh) == set(held1)
    for name, t in held_fresh.items():
        assert torch.equal(raw_bytes(t), raw_bytes(held1[name])), name
    assert sums1 == sums_fresh


def test_refused_update_returns_in_seconds(bf16_server, models):
    """A real server refuses an update it gets outside a session (400 at once, never joining the
    broadcast). qurl raises that refusal while its broadcast is in flight instead of waiting in
    it for the group timeout; recovery then makes the server leave the group (ending the
    abandoned broadcast) and the next sync lands."""
    eng, _ = bf16_server
    _, _, _, v1 = models
    s = eng.servers[0]
    real_post = s.post_json

    def no_session(route, body, timeout, ok_404=False):  # the update session never opens (and
        # qurl's prepare call, refused there too, is skipped: the broadcast's refusal is tested)
        return None if route in ("/begin_weight_update", "/update_weights_from_tensor") \
            else real_post(route, body, timeout, ok_404)

    eng.max_restarts, s.post_json = 0, no_session
    t0 = time.monotonic()
    try:
        with pytest.raises(SGLangError, match="must run between begin_weight_update"):
            eng.load_weights(engine_chunks(v1.items(), "bf16"), version=7)
    finally:
        took = time.monotonic() - t0
        s.post_json, eng.max_restarts = real_post, 3
    print(f"refused update raised after {took:.1f}s (group timeout {eng.timeouts.group_s:.0f}s)")
    assert took < eng.timeouts.group_s / 4
    eng._recover(RuntimeError("refused"), resend=False)
    eng.load_weights(engine_chunks(v1.items(), "bf16"), version=8)  # what it served before
    (r,) = eng.generate([_req("after-refusal", PROMPTS[0], 4)])
    assert r.versions.tolist() == [8] * 4


# ------------------------------------------------------------------------------------ recovery
def test_paused_server_is_not_restarted(bf16_server):
    """A server left paused (a sync that failed half-way) is alive: recovery continues it
    instead of killing it."""
    eng, _ = bf16_server
    s = eng.servers[0]
    proc = s.proc
    s.post_json("/pause_generation", {"mode": "abort"}, 30)
    eng._recover(RuntimeError("test"), resend=False)
    assert s.proc is proc and eng.restarts == 0
    (r,) = eng.generate([_req("after", PROMPTS[0], 4)])
    assert len(r.output_ids) == 4


def test_server_killed_mid_update_recovers(bf16_server, models):
    """SIGKILL the server's process group while qurl's sync is between buckets: load_weights
    restarts it, forms a new gloo group, resends, and the server then serves v1.
    (Last of the bf16 flows: it replaces the module's server process.)"""
    eng, _ = bf16_server
    root, src, v0, v1 = models
    eng.weights.bucket_bytes = 1 << 20
    eng._form_group()  # a sender with small buckets: several announcements per sync
    victim = eng.servers[0].proc
    real = eng._announce
    seen = {"n": 0}

    def announce(version):
        inner = real(version)

        def hook(ann):
            seen["n"] += 1
            if seen["n"] == 2:
                os.killpg(victim.pid, signal.SIGKILL)
            return inner(ann)
        return hook

    eng._announce = announce
    try:
        eng.load_weights(engine_chunks(v1.items(), "bf16"), version=5)
    finally:
        eng._announce = real
    assert seen["n"] >= 3  # killed after the first bucket, then a whole resend
    assert eng.restarts == 1 and eng.servers[0].proc is not victim
    res = eng.generate([_req(f"k{i}", p, 12) for i, p in enumerate(PROMPTS)])
    assert all(int(v) == 5 for r in res for v in r.versions)
    v1_dir = write_model(root, src, {k: t.to(torch.bfloat16) for k, t in v1.items()}, "bf16_v1")
    assert _max_dev(res, _local_logprobs(v1_dir, res)) < LOGPROB_TOL


# ------------------------------------------------------------------------- qurl train, real server
def _train(tmp: Path, name: str, *sets: str) -> list[dict]:
    import json
    import sys

    from tests.sglang_real import CPU_FLAGS

    base = ["run.steps=3", "run.eval_every=0", "deploy.ckpt_every=0", "deploy.progress=false",
            "model.warmstart_steps=0", "data.eval_size=8", "data.train_size=64",
            "rollout.engine=sglang", "rollout.precision=bf16", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=12", "eval.max_new_tokens=12",
            "sglang.args=" + ",".join(CPU_FLAGS), f"deploy.dir={tmp}", f"run.name={name}",
            "deploy.torch_threads=1"]
    argv = [sys.executable, "-m", "qurl.cli", "train"]
    for kv in base + list(sets):
        argv += ["--set", kv]
    run_leaving_no_server(argv, "qurl train")
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def _check_run(recs: list[dict]) -> None:
    train = [r for r in recs if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert 0.0 <= r["reward"] <= 1.0
        # bf16 SGLang sampler vs the bf16 learner on the same weights: small but nonzero mismatch
        assert 0.0 <= r["kl_behav_prox"] < 0.05, r["kl_behav_prox"]
    assert any(r.get("kind") == "eval" for r in recs)


def test_qurl_train_sync_on_real_sglang(env, tmp_path):
    _check_run(_train(tmp_path, "sync"))
    log = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "sync" / "logs").glob("*.log"))
    assert log.count('"POST /update_weights_from_distributed HTTP/1.1" 200') >= 3


def test_qurl_train_async_one_worker_on_real_sglang(env, tmp_path):
    """The worker's SGLang engine (TP 1, qurl's sync loader) takes deltas: every version after the
    first goes as a delta (bf16: changed positions or whole tensors), verified. Warm started, 1-digit
    sums, 16 tokens: some samples are right, so steps with a gradient send changed tensors."""
    recs = _train(tmp_path, "async", "deploy.rollout=workers", "rollout.max_staleness=1",
                  "deploy.engines=1", "model.warmstart_steps=40", "data.digits=1",
                  "data.operands=2", "rollout.max_new_tokens=16")
    _check_run(recs)
    train = [r for r in recs if r.get("kind") == "train"]
    for r in train:  # the broadcast after each step
        sync = {k: v for k, v in r.items() if k.startswith("sync/") and "time" not in k}
        print(f"step {r['step']} grad_norm={r['grad_norm']:.4f} {sync}")
        falls = {k for k in sync if k.startswith("sync/fallbacks/")}
        assert r["sync/delta"] == 1.0 and falls == {"sync/fallbacks/first"}, sync
        assert 0 < r["sync/bytes"] <= r["sync/full_bytes"] and r["sync/verify_mismatches"] == 0 \
            and not any(k.startswith("async/resync/") for k in r), r
        assert r["grad_norm"] == 0 or r["sync/tensors_full"] + r["sync/tensors_delta"] > 0, sync
    acks, deltas = (sum(r[f"sync/worker_{k}acks"] for r in train) for k in ("", "delta_"))
    assert acks >= 3 and deltas == acks - 1, (acks, deltas)  # v0 full, every later one a delta
    checked = [r["sync/verified"] for r in train if r["sync/verified"] is not None]  # NaN: no ack
    assert checked and all(v == 1.0 for v in checked), [r["sync/verified"] for r in train]
