"""The failure path of weight sync, end to end, on a REAL SGLang 0.5.23 server on CPU (issue 60
item 3; tests/test_sync_failure.py is the same with the local engine).

`qurl train` (the sync loop, bf16, one launched server, full syncs) runs with a fault injected in
its own process: from version 2 on, one value of one tensor is changed on its way to the server
(the learner's digests are of the right value). The server faithfully holds the wrong value, its
in-server verification reports the tensor, qurl resyncs in full, the fault strikes again, and the
second mismatch must stop the run: exit 2, one line naming the engine and the tensor, nothing of
the failed step kept, the launched server gone. `qurl train --resume` without the fault then
finishes, every sync verified.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.sglang_real import CPU_FLAGS, SGL_PY, env, needs_sglang, sglang_pids  # noqa: F401

pytestmark = needs_sglang + [pytest.mark.timeout(1200)]

LAYER = "model.layers.0.mlp.down_proj.weight"
FAULT = f'''
import sys
import torch
from qurl.engines.sglang.update import WeightUpdates
real = WeightUpdates.load_weights

def load_weights(self, chunks, version, base=None):
    if version >= 2:
        def corrupted(items):
            for name, t in items:
                if name == {LAYER!r}:
                    t = t.clone()
                    t.view(-1)[0] += 1.0
                yield name, t
        chunks = corrupted(chunks)
    return real(self, chunks, version, base)

WeightUpdates.load_weights = load_weights
from qurl.cli import main
sys.exit(main(sys.argv[1:]))
'''


def _run(argv: list[str], mark: str) -> subprocess.CompletedProcess:
    import os

    env_ = dict(os.environ, QURL_SGLANG_PYTHON=str(SGL_PY), QURL_TEST_MARK=mark)
    proc = subprocess.run(argv, env=env_, capture_output=True, text=True, timeout=1100)
    deadline = time.monotonic() + 60
    while (left := sglang_pids(mark)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"SGLang processes outlived the run: {sorted(left)}"
    return proc


def test_a_second_mismatch_on_a_real_server_stops_the_run_in_one_line_and_resume_finishes(
        env, tmp_path):
    sets = ["run.steps=2", "run.eval_every=0", "deploy.ckpt_every=1", "deploy.progress=false",
            "model.warmstart_steps=0", "data.eval_size=4", "data.train_size=32",
            "rollout.engine=sglang", "rollout.precision=bf16", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=8", "eval.max_new_tokens=8",
            "deploy.sync.mode=full", "sglang.args=" + ",".join(CPU_FLAGS),
            f"deploy.dir={tmp_path}", "run.name=halt", "deploy.torch_threads=1"]
    argv = ["train"] + [a for kv in sets for a in ("--set", kv)]
    fault = tmp_path / "fault.py"
    fault.write_text(FAULT)
    proc = _run([sys.executable, str(fault), *argv], uuid.uuid4().hex)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("qurl: error")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "weight sync v2: SGLang" in errors[0] and LAYER in errors[0], errors[0]
    assert "--resume" in errors[0]
    run = tmp_path / "halt"
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("kind") == "train"] == [1]  # step 2: not kept
    assert sorted(p.name for p in (run / "ckpt").glob("step_*")) == ["step_000001"]

    proc = _run([sys.executable, "-m", "qurl.cli", "train", "--resume", str(run)],
                uuid.uuid4().hex)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["sync/verified"] == 1.0 for r in train), [r["sync/verified"] for r in train]
