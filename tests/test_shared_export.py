"""The 8-bit export of a multi-node launch happens once per directory (qurl/checkpoint/shared_export.py):
processes exporting the same directory at once never see a partial or deleted checkpoint; a
finished export is reused; a stale lock is taken over; a live one makes waiters fail in bounded
time with one line naming the holder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qurl.checkpoint.shared_export import REQUEST, export_shared

ROOT = Path(__file__).resolve().parents[1]

# one "node": wait for the start signal, export with the planned command's entry point, then load
# the checkpoint again and again (as its SGLang servers would) until every node has exported
NODE = r"""
import json, os, sys, time
from pathlib import Path
from qurl.checkpoint.shared_export import main
from qurl.models.export8bit import read_8bit
src, out, go, done, me, n = sys.argv[1:7]
while not os.path.exists(go):
    time.sleep(0.005)
problems = []
try:
    main(["--src", src, "--out", out, "--fmt", "int8", "--uaq-scale", "1.5"])
except BaseException as e:
    problems.append(f"export: {e!r}")
finally:
    Path(done, me).write_text("")
loads, deadline = 0, time.monotonic() + 120
while (len(os.listdir(done)) < int(n) or loads < 3) and time.monotonic() < deadline:
    try:
        state, qcfg = read_8bit(out)
        assert qcfg and qcfg["quant_method"] == "w8a8_int8" and state, "empty checkpoint"
        loads += 1
    except BaseException as e:
        problems.append(f"load {loads}: {e!r}")
        break
print(json.dumps(problems))
"""


def test_nodes_exporting_one_directory_at_once_never_see_a_partial_checkpoint(tmp_path):
    """3 processes run the export command on one directory at the same instant and keep loading
    it until all are done. Before the fix (export_8bit: `<out>.tmp`, rmtree `<out>`, rename) they
    deleted each other's temp dir and the checkpoint being loaded."""
    from qurl.models.hf import build_model

    src = build_model(tmp_path / "tiny", "tiny", seed=0)
    out, go, done = tmp_path / "run" / "sglang_int8", tmp_path / "go", tmp_path / "done"
    out.parent.mkdir()
    done.mkdir()
    n = 3
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", NODE, str(src), str(out), str(go), str(done),
                               str(k), str(n)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(n)]
    time.sleep(1.0)  # let them all start waiting
    go.write_text("")
    results = [p.communicate(timeout=240) for p in procs]
    problems = {k: (json.loads(o.strip().splitlines()[-1]) if o.strip() else [e[-800:]])
                for k, (o, e) in enumerate(results)}
    assert problems == {k: [] for k in range(n)}
    assert [p.returncode for p in procs] == [0] * n
    # exported once: one request record, no staging or lock left behind
    assert json.loads((out / REQUEST).read_text())["fmt"] == "int8"
    assert sorted(p.name for p in out.parent.iterdir()) == ["sglang_int8"]


def _src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    return src


def _writer(calls: list[Path]):
    def write(staging: Path) -> None:
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"x" * 100)
        calls.append(staging)
    return write


def test_a_finished_export_is_reused_and_another_request_replaces_it(tmp_path):
    src, out, calls = _src(tmp_path), tmp_path / "out", []
    export_shared(src, out, "int8", write=_writer(calls))
    export_shared(src, out, "int8", write=_writer(calls))
    assert len(calls) == 1  # the second call found it complete
    (out / "model.safetensors").write_bytes(b"y" * 100)  # damaged: exported again
    export_shared(src, out, "int8", write=_writer(calls))
    assert len(calls) == 2 and (out / "model.safetensors").read_bytes() == b"x" * 100
    export_shared(src, out, "fp8", write=_writer(calls))  # another request
    assert len(calls) == 3 and json.loads((out / REQUEST).read_text())["fmt"] == "fp8"


def test_a_dead_holders_lock_is_taken_over_and_a_live_one_times_out(tmp_path):
    import socket

    src, out, calls = _src(tmp_path), tmp_path / "out", []
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / "out.lock"
    lock.write_text(f"{socket.gethostname()} {dead.pid} 1 0\n")
    export_shared(src, out, "int8", write=_writer(calls), wait_s=30)
    assert len(calls) == 1 and not lock.exists()
    # a holder on another node, beating (its content changes): waiters give up after wait_s
    lock.write_text("node-7 4242 1 0\n")
    with pytest.raises(TimeoutError, match=r"no complete export after 1s \(it holds another "
                       r"export.*out.lock is held by node-7 4242$"):
        export_shared(src, out, "fp8", write=_writer(calls), wait_s=1, stale_s=60)
    # the same holder silent for stale_s: taken over
    export_shared(src, out, "fp8", write=_writer(calls), wait_s=30, stale_s=0.5)
    assert len(calls) == 2 and not lock.exists()
