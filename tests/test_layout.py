"""The package floor plan (README "Layout"): qurl's top level holds only entry points, no module is
over the 400-line norm, and the module a running SGLang server imports by its dotted path
(`--custom-weight-loader qurl.engines.sglang_loader.restore_w8a8`) still resolves and pulls in
nothing of qurl's trainer (the server's venv has no megatron, and must not need transformers)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QURL = ROOT / "qurl"


def test_top_level_holds_only_entry_points():
    modules = sorted(p.name for p in QURL.glob("*.py"))
    assert modules == ["__init__.py", "__main__.py", "cli.py", "errors.py", "types.py"]


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in QURL.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_the_server_side_loader_path_resolves_alone():
    code = ("import importlib, sys; mod, fn = 'qurl.engines.sglang_loader.restore_w8a8'.rsplit('.', 1); "
            "assert callable(getattr(importlib.import_module(mod), fn)); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('qurl', 'megatron', 'transformers', 'zmq')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "['qurl', 'qurl.engines', 'qurl.engines.sglang_loader']"
