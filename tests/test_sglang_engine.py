"""Contract tests of the SGLang adapter against tests/fake_sglang.py (a real HTTP server in its own
process that follows SGLang 0.5.23's schema and joins a real gloo weight group)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qurl.engines.factory import ServerSite, make_engine
from qurl.engines.sglang.engine import SGLangEngine, Timeouts
from qurl.engines.sglang.launcher import ServerSpec, server_command
from qurl.engines.sglang.protocol import SGLangError, SGLangUnavailable, parse_generate
from qurl.quant.named import engine_chunks
from qurl.types import GenRequest, SamplingParams
from qurl.weights.group import free_port
from qurl.weights.settings import SyncSettings

FAKE = str(Path(__file__).with_name("fake_sglang.py"))
VOCAB = 50
FAST = Timeouts(control_s=20, generate_s=30, group_s=30, launch_s=90, health_s=5)


def engine_of(cfg, model_dir: str, **kwargs):
    """`make_engine` handed the sections of `cfg`, as the sync loop and the workers hand them."""
    return make_engine(cfg.rollout, cfg.sglang, SyncSettings.of(cfg.deploy.sync), model_dir,
                       seed=cfg.run.seed,
                       site=ServerSite.of(cfg.deploy, cfg.run, cfg.algo, cfg.learner), **kwargs)


def _model_dir(tmp: Path) -> Path:
    """config.json (the fake reads vocab_size) + qurl's character tokenizer (the adapter's)."""
    from qurl.models.tokenizer import build_tokenizer

    d = tmp / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "model_type": "qwen2"}))
    if not (d / "tokenizer.json").is_file():
        build_tokenizer().save_pretrained(str(d))
    return d


def _fake_cmd(tmp: Path, port: int, delay: float = 0.002, extra: tuple[str, ...] = (),
              quantization: str = "w8a8_int8") -> list[str]:
    # the adapter's own launch flags, with the fake in place of `-m sglang.launch_server`
    flags = server_command(str(_model_dir(tmp)), port=port, quantization=quantization)[3:]
    dump = tmp / "dump"
    dump.mkdir(exist_ok=True)
    return [sys.executable, FAKE, *flags, "--dump-dir", str(dump), "--token-delay", str(delay),
            *extra]


def _expected(prompt: list[int], versions: list[int]) -> tuple[list[int], list[float]]:
    """The fake's closed-form generation (tests/fake_sglang.py docstring)."""
    ids, out, lps = list(prompt), [], []
    for v in versions:
        tok = (31 * sum(ids) + len(ids) + 7 * v) % VOCAB
        ids.append(tok)
        out.append(tok)
        lps.append(-1.0 / (v + 2))
    return out, lps


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    named = []
    for i in range(2):
        for kind, shape in (("self_attn.q_proj", (32, 48)), ("mlp.down_proj", (48, 64))):
            named.append((f"model.layers.{i}.{kind}.weight", torch.randn(*shape, generator=g)))
        named.append((f"model.layers.{i}.input_layernorm.weight", torch.randn(48, generator=g)))
    named.append(("model.embed_tokens.weight", torch.randn(VOCAB, 48, generator=g)))
    return list(engine_chunks(named, "int8", wire_dtype=torch.bfloat16))


def _same(dumped: dict[str, torch.Tensor], chunks: list[tuple[str, torch.Tensor]]) -> bool:
    return dumped.keys() == {n for n, _ in chunks} and all(
        dumped[n].dtype == t.dtype and torch.equal(dumped[n].view(torch.uint8),
                                                   t.contiguous().view(torch.uint8))
        for n, t in chunks)


def _post(url: str, route: str, body: dict) -> None:
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()


def _get(url: str, route: str):
    return json.loads(urllib.request.urlopen(url + route, timeout=10).read())


def test_parse_generate_spans_and_errors():
    reply = {"text": "", "output_ids": [5, 6, 7],
             "meta_info": {"finish_reason": {"type": "length", "length": 3},
                           "weight_version": "4",
                           "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None],
                                                     [-1.0, 7, None]],
                           "weight_versions": [{"version": "3", "start": 0, "end": 1},
                                               {"version": "4", "start": 1, "end": 3}]}}
    ids, lps, vers, finish = parse_generate(reply, "test")
    assert (ids, lps, vers, finish) == ([5, 6, 7], [-0.5, -0.25, -1.0], [3, 4, 4], "length")
    bad = json.loads(json.dumps(reply))
    bad["meta_info"]["output_token_logprobs"][1][1] = 9
    with pytest.raises(SGLangError, match=r"output_token_logprobs\[1\]"):
        parse_generate(bad, "test")
    bad = json.loads(json.dumps(reply))
    bad["meta_info"]["weight_version"] = "default"
    bad["meta_info"].pop("weight_versions")
    with pytest.raises(SGLangError, match="not an integer"):
        parse_generate(bad, "test")
    with pytest.raises(SGLangError, match="finish_reason"):
        parse_generate(reply | {"meta_info": reply["meta_info"] | {"finish_reason": None}}, "t")


def test_topk_entropy_is_a_lower_bound_exact_with_the_whole_vocabulary():
    """protocol.topk_entropy against hand-worked values and a float64 entropy: the top k's own
    -p log p terms plus the rest of the mass as one token."""
    from qurl.engines.sglang.protocol import topk_entropy

    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625], dtype=torch.float64)
    exact = float(-(p * p.log()).sum())  # 1.875 bits = 1.2997 nats
    top = [[math.log(x), i, None] for i, x in enumerate(p.tolist())]
    reply = {"output_ids": [0, 1], "meta_info": {"output_top_logprobs": [top, top[:2]]}}
    whole, two = topk_entropy(reply, "t")
    assert whole == pytest.approx(exact, rel=1e-12)
    # top 2: 0.5 ln 2 + 0.25 ln 4, and the remaining 0.25 as one token: 0.25 ln 4
    assert two == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(4), rel=1e-12)
    assert two < exact
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # a bound for any distribution and any k
        q = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64) * 3, 0)
        lq, order = q.log().sort(descending=True)
        k = int(torch.randint(1, 50, (1,), generator=g))
        rep = {"output_ids": [0], "meta_info": {"output_top_logprobs": [
            [[float(lq[j]), int(order[j]), None] for j in range(k)]]}}
        assert topk_entropy(rep, "t")[0] <= float(-(q * q.log()).sum()) + 1e-12
    with pytest.raises(SGLangError, match="was top_logprobs_num set"):
        topk_entropy({"output_ids": [0], "meta_info": {}}, "t")
    with pytest.raises(SGLangError, match=r"output_top_logprobs\[0\]"):
        topk_entropy({"output_ids": [0], "meta_info": {"output_top_logprobs": [[[0.5, 1, None]]]}}, "t")


def test_server_command_flags():
    cmd = server_command("/ckpt", port=30001, host="0.0.0.0", tp=2, quantization="w8a8_fp8",
                         extra=("--mem-fraction-static", "0.7"), python="python")
    assert cmd == ["python", "-m", "sglang.launch_server", "--model-path", "/ckpt", "--tp-size",
                   "2", "--host", "0.0.0.0", "--port", "30001", "--weight-version", "0",
                   "--quantization", "w8a8_fp8",
                   "--custom-weight-loader", "qurl.engines.sglang.inside.loader.restore_w8a8",
                   "qurl.engines.sglang.inside.loader.prepare_sync",
                   "qurl.engines.sglang.inside.loader.read_kernels",
                   "--mem-fraction-static", "0.7"]
    # bf16 and block fp8 keep their loaders after loading: no restore, only the sync loader
    for q in (None, "fp8"):
        cmd = server_command("/c", port=1, quantization=q)
        assert cmd[cmd.index("--custom-weight-loader"):] == [
            "--custom-weight-loader", "qurl.engines.sglang.inside.loader.prepare_sync",
            "qurl.engines.sglang.inside.loader.read_kernels"]
    # a user's own custom loaders are merged into the one flag (argparse nargs="*": the last
    # occurrence would replace the first)
    cmd = server_command("/c", port=1, quantization="w8a8_int8",
                         extra=("--custom-weight-loader", "a.b", "--dtype", "bfloat16"))
    i = cmd.index("--custom-weight-loader")
    assert cmd.count("--custom-weight-loader") == 1
    assert cmd[i + 1:i + 5] == ["qurl.engines.sglang.inside.loader.restore_w8a8",
                                "qurl.engines.sglang.inside.loader.prepare_sync",
                                "qurl.engines.sglang.inside.loader.read_kernels", "a.b"]
    assert cmd[-2:] == ["--dtype", "bfloat16"]


@pytest.mark.slow
def test_launch_generate_sync_partial_rollout_and_disk(tmp_path):
    port = free_port()
    eng = SGLangEngine([ServerSpec(f"http://127.0.0.1:{port}", command=_fake_cmd(tmp_path, port, 0.02))],
                       precision="int8", bucket_bytes=4096, timeouts=FAST, log_dir=tmp_path / "logs")
    try:
        assert eng.version == 0
        prompt = [3, 1, 4]
        ref, _ = _expected(prompt, [0] * 6)
        reqs = [GenRequest("a", prompt, SamplingParams(max_new_tokens=6)),
                GenRequest("b", prompt, SamplingParams(max_new_tokens=6, stop_token_ids=(ref[2],)))]
        a, b = eng.generate(reqs)
        assert a.output_ids.tolist() == ref and a.finish_reason == "length"
        assert torch.allclose(a.logprobs, torch.full((6,), -0.5)) and a.versions.tolist() == [0] * 6
        assert b.output_ids.tolist() == ref[:3] and b.finish_reason == "stop"

        # a full sync: what the server received equals the learner's chunks, byte for byte
        v1 = _named(1)
        eng.load_weights(v1, 1)
        assert eng.version == 1 and eng.last_sync.buckets > 1
        assert _same(load_file(str(tmp_path / "dump" / f"port{port}_v1.safetensors")), v1)

        # partial rollout: a sync lands while a request runs; the prefix is resubmitted
        v2, t0, fired = _named(2), time.monotonic(), []

        def between():
            if not fired and time.monotonic() - t0 > 0.25:
                fired.append(1)
                eng.load_weights(v2, 2)

        eng.top_logprobs = 3  # the entropy bound is stitched across the resubmission too
        (r,) = eng.generate([GenRequest("p", prompt, SamplingParams(max_new_tokens=40))], between)
        vers = r.versions.tolist()
        k = vers.count(1)
        assert fired and len(vers) == 40 and vers == [1] * k + [2] * (40 - k) and 0 < k < 40
        toks, lps = _expected(prompt, vers)
        assert r.output_ids.tolist() == toks and torch.allclose(r.logprobs, torch.tensor(lps))

        def bound(lp: float) -> float:  # the fake's top 3: p0, (1-p0)/2, (1-p0)/4; rest (1-p0)/4
            ps = [math.exp(lp)] + [(1 - math.exp(lp)) / d for d in (2, 4, 4)]
            return -sum(p * math.log(p) for p in ps)

        assert r.entropy is not None and len(r.entropy) == 40
        assert torch.allclose(r.entropy.double(), torch.tensor([bound(lp) for lp in lps],
                                                               dtype=torch.float64), atol=1e-6)
        eng.top_logprobs = 0
        calls = [q for q in _get(eng.servers[0].spec.url, "/_fake/requests")
                 if q["rid"].startswith("p#")]
        assert calls[-1]["input_ids"] == prompt + toks[:k]  # prompt + generated prefix
        assert calls[-1]["sampling_params"]["max_new_tokens"] == 40 - k

        # no disk fallback for W8A8 servers: real SGLang 0.5.23 reloads them through the loaders
        # that refuse online updates (the bf16 disk reload is checked on the real server)
        disk = tmp_path / "disk"
        disk.mkdir()
        save_file({n: t.contiguous() for n, t in _named(3)}, str(disk / "model.safetensors"))
        with pytest.raises(SGLangError, match="cannot reload from disk"):
            eng.update_weights_from_disk(str(disk), 3)
        (c,) = eng.generate([GenRequest("c", prompt, SamplingParams(max_new_tokens=2))])
        assert eng.version == 2 and c.versions.tolist() == [2, 2]
    finally:
        eng.close()
    assert eng.servers[0].proc.poll() is not None  # launched servers are stopped


@pytest.mark.slow
def test_dead_engine_is_restarted_and_resent_current_weights(tmp_path):
    port = free_port()
    marker = tmp_path / "died"
    cmd = _fake_cmd(tmp_path, port, extra=("--die-once-at-bucket-2", str(marker)))
    eng = SGLangEngine([ServerSpec(f"http://127.0.0.1:{port}", command=cmd)],
                       precision="int8", bucket_bytes=4096, timeouts=FAST, log_dir=tmp_path / "logs")
    dump = tmp_path / "dump" / f"port{port}_v1.safetensors"
    try:
        v1 = _named(1)
        # the server crashes in the middle of the broadcast: restarted, new group, v1 sent again
        eng.load_weights(v1, 1)
        assert marker.exists() and eng.restarts == 1 and eng.version == 1
        assert _same(load_file(str(dump)), v1)
        dump.unlink()
        first = eng.servers[0].proc
        first.kill()
        first.wait()
        (r,) = eng.generate([GenRequest("x", [2, 7], SamplingParams(max_new_tokens=4))])
        assert eng.restarts == 2 and eng.servers[0].proc is not first
        assert _same(load_file(str(dump)), v1)  # the new process got the current weights again
        assert r.versions.tolist() == [1] * 4 and r.output_ids.tolist() == _expected([2, 7], [1] * 4)[0]
        # dies again, this time found by a sync: restarted, and the NEW version lands
        eng.servers[0].proc.kill()
        eng.servers[0].proc.wait()
        v2 = _named(2)
        eng.load_weights(v2, 2)
        assert eng.restarts == 3 and eng.version == 2
        assert _same(load_file(str(tmp_path / "dump" / f"port{port}_v2.safetensors")), v2)
    finally:
        eng.close()


@pytest.mark.slow
def test_attached_server_malformed_replies_and_launch_failures(tmp_path):
    from qurl.config import load_config

    port = free_port()
    proc = subprocess.Popen(_fake_cmd(tmp_path, port), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        cfg = load_config("cpu-tiny", sets=["rollout.engine=sglang", f"sglang.urls={url}",
                                            f"deploy.dir={tmp_path}"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # attach waits for health itself; this just avoids
            try:                             # counting the fake's torch import in its timeout
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        eng = engine_of(cfg, str(_model_dir(tmp_path)))
        eng.timeouts, eng.max_restarts = Timeouts(control_s=5, generate_s=1.5, group_s=20,
                                                  launch_s=5, health_s=2), 0
        req = [GenRequest("m", [1, 2], SamplingParams(max_new_tokens=3))]
        assert eng.generate(req)[0].output_ids.numel() == 3
        for fault, msg in (("bad_json", "not JSON"), ("no_meta", "meta_info"),
                           ("short_logprobs", "output_token_logprobs has 2 entries for 3"),
                           ("nan_logprob", "finite logprob")):
            _post(url, "/_fake/fault", {"fault": fault})
            with pytest.raises(SGLangError, match=msg):
                eng.generate(req)
        _post(url, "/_fake/fault", {"fault": "hang"})  # accepts, never answers
        with pytest.raises(SGLangUnavailable, match="no answer"):
            eng.generate(req)
        _post(url, "/_fake/fault", {"fault": None})
        proc.kill()
        proc.wait()
        with pytest.raises(SGLangError, match="attached, not launched by qurl"):
            eng.generate(req)
        eng.close()
    finally:
        proc.kill()
    # a server that exits at launch, and one that never becomes healthy: clear errors
    with pytest.raises(SGLangError, match="exited with code 3"):
        SGLangEngine([ServerSpec(f"http://127.0.0.1:{free_port()}",
                                 command=[sys.executable, "-c", "import sys; sys.exit(3)"])],
                     timeouts=FAST, log_dir=tmp_path / "logs")
    p2 = free_port()
    with pytest.raises(SGLangError, match="not healthy after 3s"):
        SGLangEngine([ServerSpec(f"http://127.0.0.1:{p2}",
                                 command=_fake_cmd(tmp_path, p2, extra=("--startup-delay", "60")))],
                     timeouts=Timeouts(launch_s=3), log_dir=tmp_path / "logs")


def _wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy")


@pytest.mark.slow
def test_sync_loop_trains_against_an_attached_server_with_fp8_block_syncs(tmp_path):
    """`qurl train` (the sync loop, Megatron learner) with rollout.engine=sglang and
    precision=fp8_block: every step's weights reach the server as FP8 codes + 128x128
    `_scale_inv` scales, byte-equal to the learner's final master weights quantized."""
    from transformers import AutoConfig

    from qurl.config import load_config
    from qurl.models.convert import megatron_to_hf
    from qurl.commands.train import train

    port = free_port()
    proc = subprocess.Popen(_fake_cmd(tmp_path, port, delay=0.0, quantization="fp8"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
        cfg = load_config("cpu-tiny", sets=[
            f"deploy.dir={tmp_path}", "run.name=sg", "run.steps=2", "run.eval_every=0",
            "deploy.progress=false", "model.warmstart_steps=0", "data.eval_size=4",
            "model.dtype=float32",  # the checkpoint's model state is then the synced masters
            "rollout.engine=sglang", "rollout.precision=fp8_block", f"sglang.urls={url}",
            "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "eval.max_new_tokens=4"])
        final = train(cfg)
        served = _get(url, "/_fake/requests")
    finally:
        proc.kill()
        proc.wait()
    assert final["n"] == 4
    assert len(served) >= 2 * 4 * 2 + 2 * 4  # 2 steps x 4 prompts x 2 samples + 2 evals of 4
    from qurl.train.metrics_log import read_metrics

    trains = [r for r in read_metrics(tmp_path / "sg" / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["rollout/stalls"], r["rollout/restarts"], r["rollout/dropped"]) for r in trains] \
        == [(0, 0, 0)] * 2  # the engine's health counters reach every train record
    dump = load_file(str(tmp_path / "dump" / f"port{port}_v2.safetensors"))
    run = tmp_path / "sg"
    state = torch.load(run / "ckpt" / "step_000002" / "model_rank0.pt", weights_only=False)["model"]
    hf_cfg = AutoConfig.from_pretrained(str(run / "base_model"), local_files_only=True)
    masters = megatron_to_hf([state], hf_cfg)  # fp32 model: the masters the learner synced
    # what passes through travels in the server's dtype: SGLang's auto rule serves the fp32
    # tiny checkpoint in fp16 (qurl.engines.factory.engine_wire_dtype), half the bytes of the masters
    expected = list(engine_chunks(masters.items(), "fp8_block", wire_dtype=torch.float16))
    assert _same(dump, expected) and dump["model.embed_tokens.weight"].dtype == torch.float16
    scale = dump["model.layers.0.mlp.gate_proj.weight_scale_inv"]
    assert dump["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert scale.dtype == torch.float32 and scale.dim() == 2


@pytest.mark.slow
def test_async_worker_drives_its_sglang_server(tmp_path, runs_dir):
    """deploy.rollout=workers with rollout.engine=sglang: the worker's engine is the SGLang adapter on
    its one server; every version goes controller -> worker (pipeline weight group) -> server
    (the adapter's group), and every prompt of the epoch is trained exactly once."""
    from pipeline_helpers import assert_each_prompt_once, tiny_cfg, use_free_dist_port
    from transformers import AutoConfig

    from qurl.commands.train import train
    from qurl.models.convert import megatron_to_hf

    port = free_port()
    proc = subprocess.Popen(_fake_cmd(tmp_path, port, delay=0.0), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    use_free_dist_port()
    try:
        _wait_healthy(url)
        cfg = tiny_cfg(runs_dir("asg"), "asg", 4, **{
            "deploy.rollout": "workers", "rollout.max_staleness": 1, "deploy.engines": 1,
            "rollout.engine": "sglang", "sglang.urls": url, "rollout.precision": "int8",
            "model.dtype": "float32"})  # the checkpoint's model state is then the synced masters
        final = train(cfg)
        served = _get(url, "/_fake/requests")
    finally:
        proc.kill()
        proc.wait()
    run = Path(cfg.deploy.dir) / "asg"
    assert 0.0 <= final["accuracy"] <= 1.0
    assert_each_prompt_once(cfg, run)
    assert len(served) >= 4 * 4 * 4  # every rollout request went to the server (none for eval)
    state = torch.load(run / "ckpt" / "step_000004" / "model_rank0.pt", weights_only=False)["model"]
    masters = megatron_to_hf([state], AutoConfig.from_pretrained(str(run / "base_model"),
                                                                 local_files_only=True))
    dump = load_file(str(tmp_path / "dump" / f"port{port}_v4.safetensors"))
    assert _same(dump, list(engine_chunks(masters.items(), "int8", wire_dtype=torch.float16)))
    assert dump["model.norm.weight"].dtype == torch.float16  # the workers' servers' dtype


def test_recovery_closes_an_open_w8a8_session_without_repacking_twice(tmp_path):
    """A sync that died between begin_weight_update and qurl's restore leaves a W8A8 server in a
    session with repacked layers; closing it as is would repack them again (the fake imitates
    real SGLang here). Recovery restores first, then closes, and continues the paused server."""
    port = free_port()
    eng = SGLangEngine([ServerSpec(f"http://127.0.0.1:{port}", command=_fake_cmd(tmp_path, port))],
                       precision="int8", timeouts=FAST, log_dir=tmp_path / "logs")
    try:
        url = eng.servers[0].spec.url
        eng.servers[0].post_json("/pause_generation", {"mode": "abort"}, 5)
        eng.servers[0].post_json("/begin_weight_update", {}, 5)
        eng._recover(RuntimeError("sync died"), resend=False)
        state = _get(url, "/_fake/state")
        assert state == {"session": False, "restored": False, "transposed_twice": False,
                         "paused": False}
        assert eng.restarts == 0
    finally:
        eng.close()


def test_w8a8_engine_refuses_a_server_without_the_restore_loader(tmp_path):
    """The fake answers /server_info like SGLang; a w8a8 server without qurl's loader is refused
    before any update (asking it for the restore would kill it)."""
    port = free_port()
    cmd = _fake_cmd(tmp_path, port, quantization="fp8")  # block fp8: no restore flag planned
    cmd[cmd.index("--quantization") + 1] = "w8a8_int8"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}")
        with pytest.raises(SGLangError, match="without --custom-weight-loader"):
            SGLangEngine([ServerSpec(f"http://127.0.0.1:{port}")], precision="int8", timeouts=FAST)
        assert proc.poll() is None  # refused before anything could kill it
    finally:
        proc.kill()
        proc.wait()


def test_stop_all_stops_stubborn_servers_and_their_children_together(tmp_path, monkeypatch):
    """Two launched "servers" whose leader and child both ignore SIGTERM (as a busy SGLang can be
    slow to honour it): stop_all escalates to SIGKILL on each process group, the children with
    their leaders, and an attached server (no process) is left alone."""
    import qurl.engines.sglang.launcher as launcher

    monkeypatch.setattr(launcher, "STOP_WAIT_S", 1.0)
    stubborn = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
                "print(c.pid, flush=True); time.sleep(600)")
    servers, children = [], []
    for i in range(2):
        s = launcher.Server(ServerSpec(f"http://127.0.0.1:{free_port()}",
                                       command=[sys.executable, "-c", stubborn]), tmp_path)
        s.launch()
        servers.append(s)
    for s in servers:
        deadline = time.monotonic() + 60
        while not (s.log_path.is_file() and s.log_path.read_text().strip()):
            assert time.monotonic() < deadline, "the stub never started its child"
            time.sleep(0.05)
        children.append(int(s.log_path.read_text().split()[0]))
    attached = launcher.Server(ServerSpec(f"http://127.0.0.1:{free_port()}"), None)
    launcher.stop_all([*servers, attached])
    assert [s.proc.returncode for s in servers] == [-9, -9]  # SIGTERM ignored: SIGKILLed
    for pid in children:  # the group's other member went too (reaped by init, or a zombie)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and \
                Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z":
            assert time.monotonic() < deadline, f"child {pid} outlived its server's group"
            time.sleep(0.05)
