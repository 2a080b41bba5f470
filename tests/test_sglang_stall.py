"""A wedged SGLang server is found within sglang.stall_s (issue 59 item 6).

A server whose scheduler is stuck still answers /model_info (its HTTP process serves that alone),
so a ping cannot tell; its /generate calls used to wait the full generate timeout (1,800 s by
default). qurl/engines/sglang/watchdog.py probes the progress of a busy server's requests
(/health_generate) and, after stall_s without any, cuts its calls: a server qurl launched is
restarted, an attached one dropped from routing, and the last one stops the run with a one-line
error. These tests wedge tests/fake_sglang.py (`wedge`: what a real server does when its scheduler
is SIGSTOPped, which tests/test_sglang_real_stall.py does); the generate timeout is 30 s, so
without the watchdog every request sent to the wedged server waits 30 s and more.
"""
from __future__ import annotations

import subprocess
import time

import pytest

from qurl.engines.sglang.engine import SGLangEngine, Timeouts
from qurl.engines.sglang.launcher import ServerSpec
from qurl.engines.sglang.protocol import SGLangError
from qurl.types import GenRequest, SamplingParams
from qurl.weights.group import free_port
from test_sglang_engine import _expected, _fake_cmd, _get, _post, _wait_healthy

STALL_S = 2.0
TIMEOUTS = Timeouts(control_s=20, generate_s=30, group_s=30, launch_s=90, health_s=5,
                    stall_s=STALL_S)
TOKENS = 16


def _requests(n: int) -> list[GenRequest]:
    return [GenRequest(rid=f"r{i}", prompt_ids=[1, 2, 3 + i],
                       params=SamplingParams(max_new_tokens=TOKENS)) for i in range(n)]


def _check(results: list) -> None:
    """Every request complete, token for token what an uninterrupted server generates."""
    for r in results:
        assert r.output_ids.tolist() == _expected(r.prompt_ids, [0] * TOKENS)[0]
        assert r.finish_reason == "length"


def test_a_wedged_launched_server_is_restarted_and_its_requests_finish(tmp_path):
    specs = []
    for _ in range(2):
        port = free_port()
        specs.append(ServerSpec(f"http://127.0.0.1:{port}",
                                command=_fake_cmd(tmp_path, port, delay=0.02)))
    eng = SGLangEngine(specs, precision="int8", timeouts=TIMEOUTS, log_dir=tmp_path / "logs",
                       max_restarts=1)
    try:
        wedged = eng.servers[0]
        first = wedged.proc
        _post(wedged.spec.url, "/_fake/fault", {"fault": "wedge"})
        assert _get(wedged.spec.url, "/model_info")["is_generation"]  # the ping still answers
        t0 = time.monotonic()
        res = eng.generate(_requests(8))
        took = time.monotonic() - t0
        _check(res)
        assert eng.stats() == {"rollout/stalls": 1, "rollout/restarts": 1, "rollout/dropped": 0}
        assert wedged.proc is not first and first.poll() is not None  # a new process
        assert took < TIMEOUTS.generate_s, f"{took:.1f}s: the wedged server's requests waited"
        _check(eng.generate(_requests(4)))  # the restarted server serves again
        assert eng.stalls == 1
    finally:
        eng.close()


def test_a_wedged_attached_server_is_dropped_and_the_last_one_stops_the_run(tmp_path):
    procs, urls = [], []
    for _ in range(2):
        port = free_port()
        procs.append(subprocess.Popen(_fake_cmd(tmp_path, port, delay=0.02),
                                      start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    eng = None
    try:
        for u in urls:
            _wait_healthy(u)
        eng = SGLangEngine([ServerSpec(u) for u in urls], precision="int8", timeouts=TIMEOUTS,
                           log_dir=tmp_path / "logs")
        _post(urls[0], "/_fake/fault", {"fault": "wedge"})
        t0 = time.monotonic()
        res = eng.generate(_requests(8))
        took = time.monotonic() - t0
        _check(res)
        assert eng.dropped == [urls[0]] and [s.spec.url for s in eng.servers] == [urls[1]]
        assert eng.stats() == {"rollout/stalls": 1, "rollout/restarts": 0, "rollout/dropped": 1}
        assert took < TIMEOUTS.generate_s, f"{took:.1f}s: the wedged server's requests waited"
        # the last server wedges too: the run stops, in one line naming it and the stall
        _post(urls[1], "/_fake/fault", {"fault": "wedge"})
        t0 = time.monotonic()
        with pytest.raises(SGLangError, match=f"server {urls[1]} made no progress for 2s") as e:
            eng.generate(_requests(2))
        assert time.monotonic() - t0 < TIMEOUTS.generate_s
        msg = str(e.value)
        assert "\n" not in msg and "no other server is left" in msg, msg
        assert eng.stalls == 2
    finally:
        for u in urls:  # un-wedge, so that closing the engine's group is quick
            try:
                _post(u, "/_fake/fault", {"fault": None})
            except OSError:
                pass
        if eng is not None:
            eng.close()
        for p in procs:
            p.kill()
            p.wait()
