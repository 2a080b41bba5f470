"""Test-only CPU fix for SGLang 0.5.23's routed-experts capture (`--enable-return-routed-experts`).

Python imports `sitecustomize` at every start when it is on `sys.path`; the real-server tests put
this directory on the servers' PYTHONPATH (tests/sglang_real.py `server_env`), so every SGLang
process (launcher, scheduler, detokenizer) runs this file. It changes nothing until SGLang imports
`sglang.srt.mem_cache.pool_host.common`, and nothing at all in a process that never does.

What it fixes. The routed-experts capturer keeps a host copy of every token's top-k expert ids,
`[tokens, layers, k]` int32, allocated through `ALLOC_MEMORY_FUNCS[device]`
(`srt/state_capturer/base.py:67-74`, `pin_memory=True`). For any device but npu/musa/xpu that is
`alloc_with_host_register` (`srt/mem_cache/pool_host/common.py:453-460`), which calls
`cudaHostRegister` on the buffer (`common.py:349` -> `_cuda_host_register`, `common.py:147`
`torch.cuda.cudart()`): on a CPU build of torch the scheduler dies at startup with "Torch not
compiled with CUDA enabled". Page-locking is a CUDA copy optimisation, meaningless on a CPU, so
here the `cpu` entry allocates the same buffer (SGLang's own host allocator) without registering
it; `BaseHostCache.destroy` unregisters only on CUDA/HIP (`base.py:82-87`).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "sglang.srt.mem_cache.pool_host.common"


def _patch(module) -> None:
    def alloc_unregistered(dims, dtype, device, pin_memory, allocator,
                           registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unregistered


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps TARGET's loader so that _patch runs once it has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport())
