"""The command line as a user meets it: `python -m qurl` is the `qurl` script."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def qurl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m qurl ARGS` with this checkout first on the path; capture both streams."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env.pop("MASTER_PORT", None)
    return subprocess.run([sys.executable, "-m", "qurl", *args], capture_output=True, text=True,
                          env=env, cwd=str(REPO), timeout=timeout)


def test_python_dash_m_qurl_is_the_cli():
    out = qurl("--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: qurl ")
    for cmd in ("train", "eval", "report", "compare", "bench", "launch"):
        assert cmd in out.stdout.splitlines()[0]
    bad = qurl("no-such-command")
    assert bad.returncode == 2 and "invalid choice: 'no-such-command'" in bad.stderr
