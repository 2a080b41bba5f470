"""Per-server rollout concurrency (issue 59 item 4): each SGLang server gets as many requests at
once as it reports it runs (/server_info, qurl/engines/sglang/protocol.py `running_limit`), not a
share of one global cap. Counted at the servers: tests/fake_sglang.py records the most requests
that generated at once (`/_fake/peak`); its /server_info follows SGLang 0.5.23's fields."""
from __future__ import annotations

import json
import urllib.request

from qurl.engines.sglang.engine import UNREPORTED_RUNNING, SGLangEngine
from qurl.engines.sglang.launcher import ServerSpec
from qurl.engines.sglang.protocol import running_limit
from qurl.types import GenRequest, SamplingParams
from qurl.weights.group import free_port
from test_sglang_engine import FAST, _fake_cmd


def _peak(url: str) -> int:
    with urllib.request.urlopen(url + "/_fake/peak", timeout=10) as r:
        return int(json.loads(r.read())["peak_running"])


def _engine(tmp_path, limits: list[int], **kw) -> SGLangEngine:
    specs = []
    for limit in limits:
        port = free_port()
        cmd = _fake_cmd(tmp_path, port, delay=0.02,
                        extra=("--max-running-requests", str(limit)))
        specs.append(ServerSpec(f"http://127.0.0.1:{port}", command=cmd))
    return SGLangEngine(specs, precision="int8", timeouts=FAST, log_dir=tmp_path / "logs", **kw)


def _requests(n: int, tokens: int = 12) -> list[GenRequest]:
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    return [GenRequest(rid=f"r{i}", prompt_ids=[1, 2, 3 + i % 7], params=params)
            for i in range(n)]


def test_running_limit_reads_sglang_server_info_fields():
    """The effective cap per DP rank, summed; else the flag; else unknown."""
    states = [{"effective_max_running_requests_per_dp": 48},
              {"effective_max_running_requests_per_dp": 48}]
    assert running_limit({"internal_states": states, "max_running_requests": None}) == 96
    assert running_limit({"internal_states": [], "max_running_requests": 7}) == 7
    assert running_limit({"max_running_requests": None, "tp_size": 1}) is None
    assert running_limit({"internal_states": [{"effective_max_running_requests_per_dp": 0}]}) \
        is None
    assert running_limit(None) is None


def test_each_server_gets_its_own_limit_in_flight(tmp_path):
    """Two servers reporting 3 and 5: 40 requests keep exactly 3 and 5 in flight at them (before,
    least-in-flight routing under one 256 cap sent ~20 to each at once)."""
    eng = _engine(tmp_path, [3, 5])
    try:
        assert [s.max_running for s in eng.servers] == [3, 5] and eng.capacity == 8
        out = eng.generate(_requests(40))
        assert len(out) == 40 and all(len(r.output_ids) > 0 for r in out)
        assert [_peak(s.spec.url) for s in eng.servers] == [3, 5]
    finally:
        eng.close()


def test_config_override_caps_every_server(tmp_path):
    """sglang.max_running (here the constructor's max_running) overrides what servers report."""
    eng = _engine(tmp_path, [6, 6], max_running=2)
    try:
        assert [s.max_running for s in eng.servers] == [2, 2]
        eng.generate(_requests(16, tokens=6))
        assert [_peak(s.spec.url) for s in eng.servers] == [2, 2]
        assert UNREPORTED_RUNNING == 256  # the fallback for servers that report no cap
    finally:
        eng.close()
