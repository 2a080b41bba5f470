"""The post-repack read-back's rules, without a server (qurl/engines/sglang/inside/readback.py).

A layer whose quant method is SGLang's `W8A8Int8LinearMethod` (a stand-in class of that name, in
a stand-in module whose flags say "GPU path") holds its weight [in, out] for the kernel; the
read-back recomputes the HF [out, in] values from it, so a square weight left in the loading
layout (which the in-session check, reading through qurl's restore, would call right) shows as
wrong values. The read-back session's one-shot no-op repack puts back whatever the method had.
"""
from __future__ import annotations

import sys
import types

import torch

from qurl.engines.sglang.inside import readback

MOD = types.ModuleType("fake_sglang_w8a8")
MOD._is_cpu = False
sys.modules[MOD.__name__] = MOD
W8A8Int8LinearMethod = type("W8A8Int8LinearMethod", (), {
    "__module__": MOD.__name__, "process_weights_after_loading": lambda self, layer: None})


def _layer(weight_kernel: torch.Tensor) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.quant_method = W8A8Int8LinearMethod()
    layer.weight = torch.nn.Parameter(weight_kernel, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.ones(weight_kernel.shape[1], 1),
                                            requires_grad=False)
    return layer


def test_the_read_back_reads_the_w8a8_weight_as_the_kernel_does():
    hf = torch.arange(16, dtype=torch.int8).reshape(4, 4)  # square: the shape cannot tell
    model = torch.nn.Module()
    model.proj = _layer(hf.t())  # the repack's [in, out] view
    params, unknown = readback.kernel_params(model)
    assert not unknown and torch.equal(params["proj.weight"], hf)
    model.proj = _layer(hf.clone())  # left in the loading layout: the kernel reads hf.t()
    params, _ = readback.kernel_params(model)
    assert torch.equal(params["proj.weight"], hf.t()) and not torch.equal(hf.t(), hf)
    MOD._is_cpu = True  # SGLang's CPU engine on x86: AMX packing, a layout not known here
    try:
        assert "unknown" in readback.kernel_params(model)[1]["proj.weight"]
    finally:
        MOD._is_cpu = False


def test_the_read_back_session_skips_its_closing_repack_once_and_puts_back_the_method():
    calls = []
    model = torch.nn.Module()
    model.a, model.b = _layer(torch.zeros(2, 3, dtype=torch.int8)), None
    own = lambda layer: calls.append("own")  # noqa: E731 - an instance's own repack
    model.a.quant_method.process_weights_after_loading = own
    readback._skip_once(model.a.quant_method, model.a)
    model.a.quant_method.process_weights_after_loading(model.a)  # the session's end: skipped
    assert calls == [] and model.a.quant_method.process_weights_after_loading is own
    readback._skip_once(model.a.quant_method, model.a)
    readback.clear_skips(model)  # a read-back session that never ended: the next one repacks
    model.a.quant_method.process_weights_after_loading(model.a)
    assert calls == ["own"]
