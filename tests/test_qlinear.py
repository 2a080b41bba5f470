"""W8A8 linears: exact against float64 references built from the same codes, close to nn.Linear."""
from __future__ import annotations

import pytest
import torch

from qurl.engines.kernels import fbgemm_int8_available, int8_matmul, scaled_mm_available
from qurl.engines.qlinear import Fp8Linear, Int8Linear, from_linear
from qurl.quant.formats import quantize_per_token


def _linear(inp=40, out=24, bias=True, seed=0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inp, out, bias=bias)


def _reference(mod, x: torch.Tensor) -> torch.Tensor:
    """float64 y = (xq @ Wq^T) * x_scale * w_scale^T + b from the module's own codes."""
    xq, xs = quantize_per_token(x.reshape(-1, mod.in_features), mod.fmt)
    y = (xq.double() @ mod.weight.double().t()) * xs.double() * mod.weight_scale.double().t()
    if mod.bias is not None:
        y = y + mod.bias.double()
    return y.reshape(*x.shape[:-1], mod.out_features)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("bias", [True, False])
def test_quant_linear_equals_code_reference(fmt, bias):
    lin = _linear(bias=bias)
    mod = from_linear(lin, fmt)
    assert isinstance(mod, {"int8": Int8Linear, "fp8": Fp8Linear}[fmt])
    x = torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(1))
    y = mod(x)
    assert y.shape == (2, 5, 24) and y.dtype == torch.float32
    # int8: the int32 product is exact, only the fp32 rescale rounds; fp8: fp32 summation order.
    assert torch.allclose(y.double(), _reference(mod, x), rtol=1e-5, atol=1e-5)
    # And it approximates the full-precision layer (8-bit weights and activations).
    ref = lin(x).detach()
    rel = (y - ref).norm() / ref.norm()
    assert rel < {"int8": 0.02, "fp8": 0.06}[fmt]
    assert mod(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_int_mm_is_used_with_int8_operands(monkeypatch):
    mod = from_linear(_linear(), "int8")
    monkeypatch.setattr(mod, "backend", "int_mm")
    seen = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: seen.append((a.dtype, b.dtype)) or real(a, b))
    mod(torch.randn(3, 40))
    assert seen == [(torch.int8, torch.int8)]


def test_fp8_backends_agree():
    mod = from_linear(_linear(inp=64, out=32), "fp8")
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    mod.backend = "emulate"
    emulated = mod(x)
    if not scaled_mm_available(x.device):
        pytest.skip("torch._scaled_mm does not run on this device")
    mod.backend = "scaled_mm"
    assert torch.allclose(mod(x), emulated, rtol=1e-5, atol=1e-5)


def test_load_codes_validates_and_refreshes_fp8_cache():
    a, b = from_linear(_linear(seed=0), "fp8"), from_linear(_linear(seed=1), "fp8")
    x = torch.randn(4, 40)
    a(x)  # fills the widened-weight cache
    a.load_codes(b.weight, b.weight_scale)
    a.bias.copy_(b.bias)
    assert torch.equal(a(x), b(x))
    with pytest.raises(ValueError, match="weight: expected fp8 codes"):
        a.load_codes(b.weight.float(), b.weight_scale)
    with pytest.raises(ValueError, match="weight_scale: expected float scale"):
        a.load_codes(b.weight, b.weight_scale.t())
    with pytest.raises(ValueError, match="finite and > 0"):
        a.load_codes(b.weight, -b.weight_scale)
    nan = b.weight.detach().clone()
    nan.view(torch.uint8)[3, 7] = 0xFF  # -NaN in E4M3FN
    with pytest.raises(ValueError, match="fp8 codes contain NaN"):
        a.load_codes(nan, b.weight_scale)
    assert torch.equal(a(x), b(x))  # refused: nothing written
    with pytest.raises(ValueError, match="fmt must be one of"):
        from_linear(_linear(), "int4")


@pytest.mark.skipif(not fbgemm_int8_available(), reason="FBGEMM int8 not usable on this CPU/build")
def test_fbgemm_int8_equals_int_mm_bit_for_bit(monkeypatch):
    """The FBGEMM path (split signed codes into two 7-bit halves, unit scales) is the same exact int8
    GEMM as torch._int_mm: equal outputs, on saturating codes and on a reloaded weight."""
    lin = _linear(inp=96, out=48, bias=True)
    mod = from_linear(lin, "int8")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 96, generator=g)
    x[0] = 5.0  # every code +127 (against the weight's own extremes: the saturating case)
    x[1, ::2], x[1, 1::2] = -3.0, 3.0
    outs = {}
    for backend in ("int_mm", "fbgemm"):
        monkeypatch.setattr(mod, "backend", backend)
        outs[backend] = mod(x), mod(x.to(torch.bfloat16))
    assert torch.equal(outs["int_mm"][0], outs["fbgemm"][0])
    assert torch.equal(outs["int_mm"][1], outs["fbgemm"][1])
    mod.load_codes(*mod.quantize(torch.randn(48, 96, generator=g)))  # the packed cache must refresh
    a = mod(x)
    monkeypatch.setattr(mod, "backend", "int_mm")
    assert torch.equal(a, mod(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int8_matmul_cuda_padding_matches_cpu():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (3, 20), generator=g, dtype=torch.int8)  # M <= 16, K % 8 != 0
    w = torch.randint(-127, 128, (12, 20), generator=g, dtype=torch.int8)  # N % 8 != 0
    assert torch.equal(int8_matmul(a.cuda(), w.cuda()).cpu(), int8_matmul(a, w))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_fused_siblings_equal_separate_linears_and_follow_new_codes(fmt):
    """q/k/v run as one GEMM give each member its own output (int8 bit-equal; fp8 up to fp32
    summation order), hold no second copy of the codes, and pick up codes loaded into a member."""
    import copy

    from qurl.engines.qlinear import Siblings

    alone = [from_linear(_linear(inp=64, out=n, bias=True, seed=n), fmt) for n in (32, 16, 16)]
    fused = copy.deepcopy(alone)
    Siblings(fused)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 64, generator=g)

    def check():
        for a, f in zip(alone, fused):
            want, got = a(x), f(x)
            assert got.shape == want.shape == (3, 4, a.out_features)
            if fmt == "int8":
                assert torch.equal(got, want)
            else:
                assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)

    check()
    assert fused[1].weight.data_ptr() == fused[0].weight.data_ptr() + 32 * 64  # views, one copy
    codes, scale = alone[1].quantize(torch.randn(16, 64, generator=g))
    alone[1].load_codes(codes, scale)
    fused[1].load_codes(codes, scale)
    check()
    fused[2].weight.data = alone[2].weight.clone()  # a buffer swap (the engine's adopt path)
    alone[2].load_codes(*alone[2].quantize(torch.randn(16, 64, generator=g)))
    fused[2].weight.data, fused[2].weight_scale.data = alone[2].weight.clone(), alone[2].weight_scale.clone()
    check()
