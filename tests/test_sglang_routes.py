"""A mixture of experts' routes through qurl's SGLang engine, against tests/fake_sglang.py.

Routing replay (algo.routing_replay=rollout) makes the learner use the experts the rollout engine
chose at every position and layer (qurl/types.py `GenResult.routed_experts`, [P + T - 1, L, k]).
SGLang returns them when the server runs with `--enable-return-routed-experts` and a request asks
(`return_routed_experts`; protocol.py "Routes"). Checked here: the reply's base64 int32 becomes
the local engine's uint8 [P + T - 1, L, k]; a reply of the wrong size, or from a server without
the flag, is a one-line SGLangError; a request continued after a weight update (partial rollout)
keeps the routes of the positions its first call forwarded and asks the server only for the rest
(`routed_experts_start_len`), so every position's experts are those of the weights that forwarded
it, as in the local engine. The real server is tests/test_sglang_real_moe.py.
"""
from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from qurl.engines.sglang.engine import SGLangEngine
from qurl.engines.sglang.protocol import SGLangError, parse_routes
from qurl.types import GenRequest, SamplingParams
from qurl.weights.group import free_port
from tests.test_sglang_engine import FAST, VOCAB, _expected, _fake_cmd, _get, _named, _wait_healthy

L, K, E = 2, 2, 8
MOE = (L, K, E)


def _moe_dir(tmp: Path) -> Path:
    """The fake's model directory, made a Qwen3-MoE (the fake routes from these fields)."""
    from tests.test_sglang_engine import _model_dir

    d = _model_dir(tmp)
    (d / "config.json").write_text(json.dumps({
        "vocab_size": VOCAB, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": E, "num_experts_per_tok": K, "num_hidden_layers": L,
        "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}))
    return d


def _reply(n_in: int, out: list[int], rows: np.ndarray) -> dict:
    raw = base64.b64encode(rows.astype("<i4").tobytes()).decode()
    return {"output_ids": out, "meta_info": {"routed_experts": raw}}


def _closed_form(seq: list[int], fwd: list[int]) -> torch.Tensor:
    """The fake's experts (fake_sglang.py docstring): position i, forwarded at version fwd[i]."""
    return torch.tensor([[[(7 * seq[i] + 3 * lay + v + j) % E for j in range(K)]
                          for lay in range(L)] for i, v in enumerate(fwd)], dtype=torch.uint8)


def test_parse_routes_shape_dtype_and_errors():
    rng = np.random.default_rng(0)
    rows = rng.integers(0, E, size=(5 + 3 - 1, L, K))
    got = parse_routes(_reply(5, [1, 2, 3], rows), "w", n_input=5, start=0, shape=MOE)
    assert got.dtype == torch.uint8 and got.shape == (7, L, K)
    assert torch.equal(got.long(), torch.from_numpy(rows))
    # from a start: only the positions [start, input + output - 1)
    got = parse_routes(_reply(5, [1, 2, 3], rows[4:]), "w", n_input=5, start=4, shape=MOE)
    assert torch.equal(got.long(), torch.from_numpy(rows[4:]))
    # more than 256 experts: int32 (qurl/pipeline/payload.py)
    big = parse_routes(_reply(5, [1, 2, 3], rows + 300), "w", n_input=5, start=0,
                       shape=(L, K, 512))
    assert big.dtype == torch.int32 and int(big.max()) >= 300
    assert parse_routes({"output_ids": [], "meta_info": {}}, "w", n_input=5, start=0,
                        shape=MOE) is None
    for reply, msg in ((_reply(5, [1, 2, 3], rows[1:]), r"has 24 ids, expected \[5 \+ 3 - 1 - 0"),
                       (_reply(5, [1, 2, 3], rows + E), r"outside \[0, 8\)"),
                       ({"output_ids": [1], "meta_info": {"routed_experts": "abc"}}, "base64")):
        with pytest.raises(SGLangError, match=msg) as e:
            parse_routes(reply, "POST /generate on x", n_input=5, start=0, shape=MOE)
        assert "\n" not in str(e.value) and str(e.value).startswith("POST /generate on x")


def _engine(tmp: Path, port: int, *, flag: bool = True, delay: float = 0.002) -> SGLangEngine:
    cmd = _fake_cmd(tmp, port, delay, extra=("--enable-return-routed-experts",) if flag else ())
    _moe_dir(tmp)  # after _fake_cmd, which writes a dense config.json
    from qurl.engines.sglang.launcher import ServerSpec

    return SGLangEngine([ServerSpec(f"http://127.0.0.1:{port}", command=cmd)], precision="int8",
                        bucket_bytes=4096, timeouts=FAST, log_dir=tmp / "logs", routes=MOE)


def test_routes_of_every_position_also_across_a_partial_rollout(tmp_path):
    port = free_port()
    eng = _engine(tmp_path, port, delay=0.02)
    try:
        prompt = [3, 1, 4, 1]
        (a,) = eng.generate([GenRequest("a", prompt, SamplingParams(max_new_tokens=6))])
        toks, _ = _expected(prompt, [0] * 6)
        assert a.output_ids.tolist() == toks
        assert a.routed_experts.dtype == torch.uint8 and a.routed_experts.shape == (4 + 6 - 1, L, K)
        assert torch.equal(a.routed_experts, _closed_form(prompt + toks, [0] * 9))

        # a sync lands mid-request: the continued call asks only for the positions not routed
        eng.load_weights(_named(1), 1)
        t0, fired = time.monotonic(), []

        def between():
            if not fired and time.monotonic() - t0 > 0.25:
                fired.append(1)
                eng.load_weights(_named(2), 2)

        (r,) = eng.generate([GenRequest("p", prompt, SamplingParams(max_new_tokens=40))], between)
        vers = r.versions.tolist()
        k = vers.count(1)
        assert fired and vers == [1] * k + [2] * (40 - k) and 0 < k < 40
        toks, _ = _expected(prompt, vers)
        assert r.output_ids.tolist() == toks
        # position i < P: the prompt, forwarded at version 1; P + t: forwarded when token t + 1
        # was sampled (the prefix's routes of version 1 are kept, not the resumed call's)
        fwd = [1] * len(prompt) + vers[1:]
        assert r.routed_experts.shape == (len(prompt) + 40 - 1, L, K)
        assert torch.equal(r.routed_experts, _closed_form(prompt + toks, fwd))
        calls = [q for q in _get(eng.servers[0].spec.url, "/_fake/requests")
                 if q["rid"].startswith("p#")]
        assert calls[0]["routed_experts_start_len"] == 0 and calls[0]["return_routed_experts"]
        assert calls[-1]["input_ids"] == prompt + toks[:k]
        assert calls[-1]["routed_experts_start_len"] == len(prompt) + k - 1
    finally:
        eng.close()


def test_malformed_routes_and_a_server_without_the_flag_are_one_line_errors(tmp_path):
    from tests.test_sglang_engine import _post

    port = free_port()
    eng = _engine(tmp_path, port)
    try:
        _post(eng.servers[0].spec.url, "/_fake/fault", {"fault": "short_routes"})
        with pytest.raises(SGLangError, match=r"routed_experts has 20 ids, expected \[3 \+ 4 - 1"):
            eng.generate([GenRequest("s", [1, 2, 3], SamplingParams(max_new_tokens=4))])
    finally:
        eng.close()
    port = free_port()
    eng = _engine(tmp_path, port, flag=False)
    try:
        with pytest.raises(SGLangError, match="no meta_info.routed_experts .was the server "
                                              "started with --enable-return-routed-experts"):
            eng.generate([GenRequest("n", [1, 2, 3], SamplingParams(max_new_tokens=4))])
    finally:
        eng.close()


def _launched(cfg, model: Path, monkeypatch) -> tuple[list[str], tuple | None]:
    """The server command and route shape make_engine launches `cfg`'s first server with, `model`
    standing in for its 8-bit export (no server started)."""
    from qurl.engines.sglang import from_config
    from tests.test_sglang_engine import engine_of

    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(specs, **kw):
        seen["cmd"], seen["routes"] = specs[0].command, kw["routes"]
        raise Stop

    with monkeypatch.context() as m:
        m.setattr("qurl.models.export8bit.export_8bit", lambda *a, **k: model)
        m.setattr(from_config, "SGLangEngine", fake_engine)
        with pytest.raises(Stop):
            engine_of(cfg, str(model))
    return seen["cmd"], seen["routes"]


def test_return_routes_asks_without_replay_and_a_dense_model_is_refused(tmp_path, monkeypatch):
    """sglang.return_routes=true with replay off: the launched servers get the flag and the engine
    asks for the routes (the learner then measures its flips against them); neither setting: no
    flag, no routes; asked of a dense model: one ConfigError naming both settings."""
    from qurl.config import ConfigError, load_config
    from tests.test_sglang_engine import _model_dir

    model = _moe_dir(tmp_path)
    for extra, flag in ((["sglang.return_routes=true"], 1), ([], 0)):
        cfg = load_config("cpu-tiny", sets=["rollout.engine=sglang", f"deploy.dir={tmp_path}",
                                            *extra])
        cmd, routes = _launched(cfg, model, monkeypatch)
        assert cmd.count("--enable-return-routed-experts") == flag
        assert routes == (MOE if flag else None)
    (tmp_path / "dense").mkdir()
    dense = _model_dir(tmp_path / "dense")
    cfg = load_config("cpu-tiny", sets=["rollout.engine=sglang", f"deploy.dir={tmp_path}",
                                        "sglang.return_routes=true"])
    with pytest.raises(ConfigError, match="sglang.return_routes=true: .* is a dense model"):
        _launched(cfg, dense, monkeypatch)


def test_a_replaying_run_launches_its_servers_with_the_flag_and_attaches_asking_routes(
        tmp_path, monkeypatch):
    """make_engine with algo.routing_replay=rollout: launched servers get the flag (the 8-bit
    export is skipped here), an attached server is asked for routes of the model's shape."""
    from qurl.config import load_config
    from qurl.engines.factory import ServerSite
    from tests.test_sglang_engine import engine_of

    model = _moe_dir(tmp_path)
    cfg = load_config("cpu-tiny", sets=["rollout.engine=sglang", "algo.routing_replay=rollout",
                                        f"deploy.dir={tmp_path}"])
    assert ServerSite.of(cfg.deploy, cfg.run, cfg.algo, cfg.learner).routes
    cmd, routes = _launched(cfg, model, monkeypatch)
    assert cmd.count("--enable-return-routed-experts") == 1 and routes == MOE

    port = free_port()
    cmd = _fake_cmd(tmp_path, port, extra=("--enable-return-routed-experts",))
    _moe_dir(tmp_path)  # after _fake_cmd, which writes a dense config.json
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
        cfg = load_config("cpu-tiny", sets=["rollout.engine=sglang", "algo.routing_replay=rollout",
                                            f"sglang.urls={url}", f"deploy.dir={tmp_path}"])
        eng = engine_of(cfg, str(model))
        try:
            (g,) = eng.generate([GenRequest("x", [5, 6], SamplingParams(max_new_tokens=3))])
            assert eng.routes == MOE and g.routed_experts.shape == (2 + 3 - 1, L, K)
        finally:
            eng.close()
    finally:
        proc.kill()
        proc.wait()
