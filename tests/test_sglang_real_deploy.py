"""The REAL SGLang 0.5.23 server on CPU in the setups a first multi-GPU run has (issue 20): a TP = 2
server taking qurl's 8-bit update, and `qurl eval` leaving no server behind (`make test-sglang`;
tests/sglang_real.py has the recipe, and what CPU servers can and cannot do).
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from qurl.engines.sglang.engine import SGLangEngine
from qurl.engines.sglang.launcher import ServerSpec
from qurl.engines.sglang.protocol import QUANTIZATION, SGLangError
from qurl.models.export8bit import export_8bit
from qurl.weights.publish import WeightSync
from tests.sglang_real import (  # noqa: F401
    CPU_FLAGS,
    TIMEOUTS,
    env,
    is_8bit,
    launch,
    models,
    needs_sglang,
    raw_bytes,
    read_back_ranks,
    run_leaving_no_server,
    tp_env,
    write_model,
)

pytestmark = needs_sglang + [pytest.mark.timeout(3600)]


def test_tp2_int8_update_reads_back_byte_equal(models, env, tmp_path_factory, monkeypatch):
    """A real TP = 2 server (two scheduler processes, SGLang's CPU path with one core list per
    rank) takes qurl's 8-bit update: the W8A8 restore runs on both ranks, each rank receives the
    broadcast and loads its shard. Afterwards each rank holds, byte for byte, what the same rank
    of a TP = 2 server started from the v1 checkpoint holds, every 8-bit tensor moved from v0
    and stayed at its startup address; and an engine told the wrong TP size is refused by the
    server's /server_info before any group is formed."""
    quant, fmt = QUANTIZATION["int8"]
    root, src, v0, v1 = models
    for k, v in tp_env(2).items():
        monkeypatch.setenv(k, v)
    logs = tmp_path_factory.mktemp("logs_tp2")
    ckpt0 = export_8bit(src, root / f"{fmt}_v0", fmt)
    ckpt1 = export_8bit(write_model(root, src, v1, "fp32_v1"), root / f"{fmt}_v1", fmt)
    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(launch, c, quant, logs, precision="int8", generates=False, tp=2)
                for c in (ckpt0, ckpt1)]
        engines = [f.result() for f in futs]
    eng, fresh = engines
    try:
        with pytest.raises(SGLangError, match="runs --tp-size 2 but qurl was told sglang.tp=1"):
            SGLangEngine([ServerSpec(eng.servers[0].spec.url, tp=1)], precision="int8",
                         backend="gloo", timeouts=TIMEOUTS, ready_probe="/model_info")
        before = read_back_ranks(eng, env)
        WeightSync(fmt, bucket_bytes=1 << 20, wire_dtype=torch.bfloat16).push(
            iter(v1.items()), eng, version=1)
        after, want = read_back_ranks(eng, env), read_back_ranks(fresh, env)
    finally:
        for e in engines:
            e.close()
    assert len(after) == len(want) == 2
    for rank, ((held0, ptrs0), (held1, ptrs1), (ref, _)) in enumerate(zip(before, after, want)):
        assert set(held1) == set(ref)
        for name, t in ref.items():
            assert torch.equal(raw_bytes(held1[name]), raw_bytes(t)), (rank, name)
        eight_bit = [n for n, t in held1.items() if is_8bit(t)]
        assert len(eight_bit) >= 4
        assert all(not torch.equal(raw_bytes(held0[n]), raw_bytes(held1[n])) for n in eight_bit)
        assert {n: ptrs1[n] for n in ptrs0} == ptrs0, rank
    # the two ranks hold different halves (a real split, not two copies)
    assert any(not torch.equal(raw_bytes(after[0][0][n]), raw_bytes(after[1][0][n]))
               for n in after[0][0] if is_8bit(after[0][0][n]))


def test_qurl_eval_on_real_sglang_leaves_no_server(env, tmp_path):
    """`qurl eval` of a checkpoint through a bf16 SGLang server it launches: the evaluation
    runs on the server, and the server is gone when the command returns."""
    train = ["run.steps=1", "run.eval_every=0", "deploy.ckpt_every=1", "deploy.progress=false",
             "model.warmstart_steps=0", "data.eval_size=4", "data.train_size=16",
             "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
             "eval.max_new_tokens=8", "eval.fp_policy=false", f"deploy.dir={tmp_path}",
             "run.name=ev", "deploy.torch_threads=1"]  # the local engine: fast
    argv = [sys.executable, "-m", "qurl.cli", "train"]
    for kv in train:
        argv += ["--set", kv]
    run_leaving_no_server(argv, "qurl train")
    argv = [sys.executable, "-m", "qurl.cli", "eval", str(tmp_path / "ev"), "-n", "4"]
    for kv in ("rollout.engine=sglang", "rollout.precision=bf16",
               "sglang.args=" + ",".join(CPU_FLAGS)):
        argv += ["--set", kv]
    run_leaving_no_server(argv, "qurl eval")
    logs = list((tmp_path / "ev" / "logs").glob("sglang_*.log"))
    assert logs, "qurl eval did not launch an SGLang server"
    served = "\n".join(p.read_text(errors="replace") for p in logs)
    assert served.count('"POST /generate HTTP/1.1" 200') >= 4  # the evaluation ran there
