"""`qurl.learner.dist.spawn` starts ranks as forks of one server that imported torch,
megatron-core and transformers once (qurl/learner/preload.py): a rank finds them imported before
its function runs, sees the caller's environment as it is at the call (not the server's, which
was fixed when the server started), and works in the caller's directory."""
from __future__ import annotations

import os
import sys

from qurl.learner.dist import spawn


def _probe(rank: int, ws: int) -> dict:
    return {"preloaded": all(m in sys.modules for m in ("megatron.core", "transformers.modeling_utils",
                                                          "megatron_patches.imports")),
            "probe": os.environ.get("QURL_SPAWN_PROBE"), "rank_env": os.environ["RANK"],
            "cwd": os.getcwd(), "pid": os.getpid()}


def test_ranks_fork_from_the_preloaded_server_with_the_callers_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("QURL_SPAWN_PROBE", "first")
    first = spawn(_probe, 2)
    monkeypatch.setenv("QURL_SPAWN_PROBE", "second")  # after the server started
    monkeypatch.chdir(tmp_path)
    second = spawn(_probe, 2)
    assert all(r["preloaded"] for r in first + second)
    assert [r["probe"] for r in first] == ["first"] * 2
    assert [r["probe"] for r in second] == ["second"] * 2
    assert [r["rank_env"] for r in second] == ["0", "1"]
    assert {r["cwd"] for r in second} == {str(tmp_path)}
    assert len({r["pid"] for r in first + second}) == 4 and os.getpid() not in {r["pid"] for r in second}
