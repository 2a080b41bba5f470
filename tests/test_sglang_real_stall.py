"""A real SGLang 0.5.23 server whose scheduler stops is found within sglang.stall_s and restarted.

SIGSTOP freezes the server's scheduler process (SGLang titles it `sglang::scheduler...`,
srt/managers/scheduler.py) while its HTTP process goes on answering /model_info: the wedge
issue 59 item 6 describes. qurl's watchdog (qurl/engines/sglang/watchdog.py) probes
/health_generate, which gets no output from the frozen scheduler; after stall_s it cuts the
in-flight /generate calls, the engine restarts the server it launched (a new process group, the
frozen one killed), and the requests are resubmitted and finish. The generate timeout here is
600 s: without the watchdog the requests would wait that long. Real-server test (`make
test-sglang`, marker sglang).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from qurl.engines.sglang.engine import SGLangEngine, Timeouts
from qurl.engines.sglang.launcher import ServerSpec, server_command
from qurl.models.export8bit import export_8bit
from qurl.types import GenRequest, SamplingParams
from qurl.weights.group import free_port
from tests.sglang_real import SGL_PY, cpu_server_args, env, models, needs_sglang  # noqa: F401

pytestmark = needs_sglang + [pytest.mark.timeout(1200)]

# a CPU decode step of this tiny model takes tens of ms, and SGLang's scheduler sends a busy
# non-streaming request's output every 50 tokens: 15 s leaves a loaded machine ample room
STALL_S = 15.0
PROMPTS = [[5, 17, 23, 42, 8], [60, 2, 2, 71], [33, 34, 35, 36, 37, 38, 39]]


def _schedulers(root: int) -> list[int]:
    """Descendants of process `root` titled as SGLang's scheduler (read from /proc)."""
    children: dict[int, list[tuple[int, bytes]]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append((int(d.name), (d / "cmdline").read_bytes()))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    found, todo = [], [root]
    while todo:
        for pid, cmd in children.get(todo.pop(), []):
            todo.append(pid)
            if b"sglang::scheduler" in cmd:
                found.append(pid)
    return found


def _reqs(tag: str, n: int) -> list[GenRequest]:
    return [GenRequest(rid=f"{tag}{i}", prompt_ids=p,
                       params=SamplingParams(max_new_tokens=n, temperature=0.0, top_p=1.0))
            for i, p in enumerate(PROMPTS)]


def test_a_sigstopped_scheduler_is_found_and_its_server_restarted(env, models, tmp_path):
    root, src, _, _ = models
    ckpt = export_8bit(src, root / "bf16_stall", "bf16")
    port = free_port()
    cmd = server_command(str(ckpt), port=port, extra=cpu_server_args(True), python=str(SGL_PY))
    timeouts = Timeouts(control_s=60, generate_s=600, group_s=120, launch_s=1200, health_s=10,
                        stall_s=STALL_S)
    eng = SGLangEngine([ServerSpec(f"http://127.0.0.1:{port}", command=cmd)], precision="bf16",
                       backend="gloo", timeouts=timeouts, log_dir=tmp_path / "logs",
                       vocab_size=100, max_restarts=1)
    frozen: list[int] = []
    try:
        healthy = eng.generate(_reqs("a", 48))  # a busy, healthy server is not a stall
        assert eng.stalls == 0 and all(r.output_ids.numel() > 0 for r in healthy)
        first = eng.servers[0].proc
        frozen = _schedulers(first.pid)
        assert frozen, "no sglang::scheduler process under the launched server"
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        assert eng.servers[0].alive(10.0)  # /model_info still answers: a ping would not see it
        seen: dict[str, float] = {}

        def watch() -> None:
            while eng.stalls == 0 and "done" not in seen:
                time.sleep(0.1)
            seen.setdefault("stall", time.monotonic())
        t0 = time.monotonic()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        res = eng.generate(_reqs("b", 48))
        seen.setdefault("done", time.monotonic())
        watcher.join(5)
        detect_s, total_s = seen["stall"] - t0, seen["done"] - t0
        print(f"stall found after {detect_s:.1f}s (stall_s={STALL_S:g}); generate done after "
              f"{total_s:.1f}s, restart included")
        assert eng.stalls == 1 and eng.restarts == 1 and eng.servers[0].proc is not first
        assert first.poll() is not None  # the frozen server's process is gone
        # the bound: stall_s without progress, plus at most one probe (itself at most stall_s)
        assert detect_s <= 2 * STALL_S, detect_s
        assert [r.rid for r in res] == ["b0", "b1", "b2"]
        assert all(r.finish_reason in ("length", "stop") and r.output_ids.numel() > 0 for r in res)
        assert all(r.finish_reason == "stop" or r.output_ids.numel() == 48 for r in res)
    finally:
        for pid in frozen:  # a frozen process that is still there would never exit
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        eng.close()
