"""megatron_patches/imports.py: megatron-core imported without TorchDynamo, its import-time
`torch.compile` calls deferred to first use with the same options, and nothing else changed."""
from __future__ import annotations

import subprocess
import sys

import torch

from megatron_patches.imports import compile_on_first_call


def test_compile_on_first_call_compiles_once_with_the_same_options(monkeypatch):
    calls = []

    def real(model=None, **options):  # stands in for torch.compile: records, doubles the result
        calls.append((model, options))
        return lambda *a, **k: 2 * model(*a, **k)

    monkeypatch.setattr(torch, "compile", real)

    def f(x: int) -> int:
        """doc"""
        return x + 1

    with compile_on_first_call():
        plain = torch.compile(f)
        moded = torch.compile(mode="max-autotune")(f)  # the decorator-factory form
        module = torch.compile(torch.nn.Identity(), dynamic=False)
    assert torch.compile is real  # restored on exit
    assert calls == [(calls[0][0], {"dynamic": False})]  # a module goes to the real one at once
    assert isinstance(calls[0][0], torch.nn.Identity) and module is not None
    assert (plain.__name__, plain.__doc__) == ("f", "doc")
    assert plain(1) == 4 and plain(2) == 6  # compiled on the first call, then reused
    assert moded(1) == 4
    assert calls[1:] == [(f, {}), (f, {"mode": "max-autotune"})]


def test_megatron_core_imports_without_dynamo_and_its_fusers_defer():
    code = ("import sys, torch\n"
            "from megatron_patches.imports import import_megatron_core\n"
            "import_megatron_core()\n"
            "from megatron.core import jit, parallel_state\n"
            "from megatron.core.models.gpt import gpt_model\n"
            "from megatron.core.fusions import fused_bias_swiglu as s\n"
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
            "assert jit.jit_fuser is not torch.compile\n"
            "assert s.swiglu.__name__ == 'swiglu' and not hasattr(s.swiglu, '_torchdynamo_orig_callable')\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
