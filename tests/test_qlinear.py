"""W8A8 linears: exact against float64 references built from the same codes, close to nn.Linear."""
from __future__ import annotations

import pytest
import torch

from qurl.engines import qlinear
from qurl.engines.qlinear import Fp8Linear, Int8Linear, from_linear, int8_matmul, scaled_mm_available
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
    monkeypatch.setattr(qlinear, "fast_int8_gemm", lambda device: True)
    mod = from_linear(_linear(), "int8")
    seen = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: seen.append((a.dtype, b.dtype)) or real(a, b))
    mod(torch.randn(3, 40))
    assert seen == [(torch.int8, torch.int8)]


def test_fp32_int8_product_is_exact_at_the_extremes(monkeypatch):
    """The fp32 path gives torch._int_mm's int32 result bit for bit, also where one fp32 GEMM
    over all of K would round: K = 3000 products of -128 * -128 sum to 49,152,000 > 2^24, and
    random codes with a large odd offset exercise the low bits."""
    g = torch.Generator().manual_seed(0)
    k = 3000
    a = torch.randint(-128, 128, (5, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (7, k), generator=g, dtype=torch.int8)
    a[0], w[0] = -128, -128
    a[1], w[1] = 127, 127  # 3000 * 16129 = 48,387,000: odd, > 2^24, rounds in a single fp32 sum
    ref = torch._int_mm(a, w.t())
    got = qlinear.int8_matmul_fp32(a, w.to(torch.float32))
    assert got.dtype == torch.int32 and torch.equal(got, ref)
    assert int(ref[0, 0]) == k * 128 * 128
    assert int(ref[1, 1]) == k * 127 * 127
    # The layer's slow-kernel path equals the _int_mm path, and the cache follows new codes.
    mod = from_linear(_linear(), "int8")
    x = torch.randn(6, 40, generator=g)
    monkeypatch.setattr(qlinear, "fast_int8_gemm", lambda device: True)
    fast = mod(x)
    monkeypatch.setattr(qlinear, "fast_int8_gemm", lambda device: False)
    assert torch.equal(mod(x), fast)
    other = from_linear(_linear(seed=1), "int8")
    mod.load_codes(other.weight, other.weight_scale)
    mod.bias.copy_(other.bias)
    assert torch.equal(mod(x), other(x))


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int8_matmul_cuda_padding_matches_cpu():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (3, 20), generator=g, dtype=torch.int8)  # M <= 16, K % 8 != 0
    w = torch.randint(-127, 128, (12, 20), generator=g, dtype=torch.int8)  # N % 8 != 0
    assert torch.equal(int8_matmul(a.cuda(), w.cuda()).cpu(), int8_matmul(a, w))
