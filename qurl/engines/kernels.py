"""The 8-bit GEMM kernels the W8A8 linears (qlinear.py) compute their code products with.

Each takes 8-bit codes and returns their exact integer (INT8) or fp32 (FP8) product; the layers
apply the scales.

- INT8: an exact int8 x int8 -> int32 GEMM (no dequantize-then-float), by one of two kernels
  (`Int8Linear.backend` picks):
  * `torch._int_mm` (oneDNN on CPU, cuBLAS on CUDA). On CPU it takes any shape. On CUDA it needs
    M > 16 and K, N multiples of 8, so rows are zero-padded to at least 32 and K/N to multiples of
    8 there (zero rows/columns add nothing to the sum).
  * FBGEMM (`fbgemm_int8_product`, the CPU default where it is exact): on x86 CPUs without VNNI
    (AVX2 only) oneDNN's int8 GEMM is ~20x slower than an fp32 GEMM of the same shape, while
    FBGEMM's u8 x s8 kernels are ~2x faster than fp32. FBGEMM takes *unsigned* 7-bit activations
    (its AVX2 kernels add pairs of u8*s8 products in saturating int16: 2 * 127 * 127 fits, 2 * 255 * 127
    does not), so the signed codes are split, x = max(x, 0) - max(-x, 0), both halves in [0, 127],
    stacked into one GEMM of 2M rows, and subtracted. FBGEMM's dynamic linear quantizes its float
    input itself with scale (max - min) / 127; a pinned row holding 127 makes that scale exactly 1
    and the zero point 0, so its quantization is the identity on our integer codes and its output
    is float(int32 sum) with unit weight scales: the same numbers as `_int_mm` (tested bit-equal).
- FP8: `torch._scaled_mm` (unit tensor-wise scales, fp32 output) where `scaled_mm_available` finds
  an FP8 GEMM (CUDA sm89+, probed once per device); elsewhere the layer emulates it exactly.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] >= size:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, size - t.shape[dim]]
    return nn.functional.pad(t, pad)


def int8_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int8 GEMM `a @ w^T`: a [M, K] int8, w [N, K] int8 -> [M, N] int32 via torch._int_mm."""
    if a.device.type != "cuda":
        return torch._int_mm(a, w.t())
    m, k = a.shape
    n = w.shape[0]
    k8, n8 = -(-k // 8) * 8, -(-n // 8) * 8
    a_p = _pad_to(_pad_to(a, 1, k8), 0, max(m, 32))
    w_p = _pad_to(_pad_to(w, 1, k8), 0, n8)
    return torch._int_mm(a_p, w_p.t())[:m, :n]


def fbgemm_pack(codes: torch.Tensor):
    """int8 codes [N, K] -> FBGEMM packed weight with unit scale and zero point 0.

    torch 2.13 warns that quantized tensor dtypes (qint8) are deprecated; the packing needs one.
    When they are gone, `fbgemm_int8_available()` turns False and the layers use torch._int_mm."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        q = torch._make_per_tensor_quantized_tensor(codes.contiguous(), 1.0, 0)
    return torch.ops.quantized.linear_prepack(q, None)


def fbgemm_int8_product(a: torch.Tensor, packed, pin: torch.Tensor) -> torch.Tensor:
    """Exact `a @ w^T` as fp32 via FBGEMM (see the module docstring): a [M, K] int8 codes in
    [-127, 127], `packed` from `fbgemm_pack(w)`, pin [1, K] int8 (127 then zeros) -> [M, N] fp32."""
    m = a.shape[0]
    halves = torch.cat([a, a.neg(), pin]).clamp_(min=0).to(torch.float32)  # [2M + 1, K] in [0, 127]
    out = torch.ops.quantized.linear_dynamic(halves, packed, True)  # reduce_range: 7-bit, [0, 127]
    return out[:m] - out[m : 2 * m]


_FBGEMM_OK: list[bool] = []


def fbgemm_int8_available() -> bool:
    """Whether the FBGEMM int8 product works here and equals `torch._int_mm` bit for bit (probed
    once, on extreme codes +-127 and random ones)."""
    if not _FBGEMM_OK:
        ok = torch.backends.quantized.engine in ("x86", "fbgemm") and hasattr(torch.ops, "quantized")
        if ok:
            try:
                g = torch.Generator().manual_seed(0)
                a = torch.randint(-127, 128, (6, 72), generator=g, dtype=torch.int8)
                w = torch.randint(-127, 128, (10, 72), generator=g, dtype=torch.int8)
                a[0], a[1], w[0], w[1] = 127, -127, 127, -127
                pin = torch.zeros(1, 72, dtype=torch.int8)
                pin[0, 0] = 127
                got = fbgemm_int8_product(a, fbgemm_pack(w), pin)
                ok = torch.equal(got, torch._int_mm(a, w.t()).to(torch.float32))
            except (RuntimeError, NotImplementedError, AttributeError):
                ok = False
        _FBGEMM_OK.append(ok)
    return _FBGEMM_OK[0]


_SCALED_MM_OK: dict[tuple[str, int | None], bool] = {}


def scaled_mm_available(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` on fp8 codes with fp32 output works on `device`
    (probed once: a 16x32x16 product compared with the fp32 emulation)."""
    key = (device.type, device.index)
    if key not in _SCALED_MM_OK:
        ok = hasattr(torch, "_scaled_mm")
        if ok and device.type == "cuda":
            ok = torch.cuda.get_device_capability(device) >= (8, 9)
        if ok:
            try:
                g = torch.Generator().manual_seed(0)
                a = torch.randn(16, 32, generator=g).to(device, torch.float8_e4m3fn)
                b = torch.randn(16, 32, generator=g).to(device, torch.float8_e4m3fn)
                one = torch.ones((), device=device)
                got = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
                ref = a.float() @ b.float().t()
                # fp32 accumulation order differs between the GEMM and the emulation: compare loosely
                ok = bool(torch.allclose(got, ref, rtol=1e-3, atol=1e-3))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _SCALED_MM_OK[key] = ok
    return _SCALED_MM_OK[key]
