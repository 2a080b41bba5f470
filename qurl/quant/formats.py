"""Symmetric 8-bit quantizers: INT8 and FP8-E4M3 codes with fp32 scales.

QuRL rolls out with a W8A8 copy of the policy. This module holds the number formats only:

- **Weights, per output channel** (`quantize_per_channel`): one fp32 scale per row of a linear weight
  `w: [out, in]`, `scale = absmax(row) / qmax`, codes = `w / scale` rounded into the format. This is the
  layout SGLang's `w8a8_int8` and per-channel `fp8` methods hold (`weight` codes `[out, in]`,
  `weight_scale` fp32 `[out, 1]`).
- **Activations, per token, dynamically** (`quantize_per_token`): the same recipe over the last dim of
  `x: [..., in]`, computed at run time for every token.
- **FP8 block scaling** (`quantize_fp8_block`): one scale per `block x block` tile (128x128 is what
  SGLang and slime use for FP8 checkpoints); edge tiles are partial.

Formats: INT8 codes are integers in [-127, 127] (symmetric: -128 is never produced), round half to
even. FP8 E4M3 ("fn" variant: no infinities, max finite 448) keeps 3 mantissa bits, so for values in
its normal range the round-trip relative error is <= 2^-4; values below 2^-6 (times scale) fall into
the subnormal range where the absolute error is <= 2^-10 * scale.

Invariants:
- scales are fp32, finite and > 0. A row (token, tile) that is all zero gets scale 1.0 and zero codes,
  so dequantization gives exact zeros and nothing divides by zero.
- codes never saturate into NaN: values are clamped to +-qmax before the cast (a plain cast of an
  out-of-range float to float8_e4m3fn gives NaN in torch).
- non-finite input (NaN/inf) is refused with ValueError rather than quietly encoded.
- arithmetic happens in fp32 whatever the input dtype (bf16 weights are upcast first).
"""

from __future__ import annotations

from typing import Literal

import torch

Fmt = Literal["int8", "fp8"]
FP8_MAX = 448.0
INT8_MAX = 127
FORMATS: tuple[str, ...] = ("int8", "fp8")

_CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def qmax(fmt: Fmt) -> float:
    """Largest code magnitude of `fmt`: 127 for INT8, 448 for FP8 E4M3."""
    check_fmt(fmt)
    return float(INT8_MAX) if fmt == "int8" else FP8_MAX


def code_dtype(fmt: Fmt) -> torch.dtype:
    """torch dtype of the codes of `fmt` (torch.int8 or torch.float8_e4m3fn)."""
    check_fmt(fmt)
    return _CODE_DTYPES[fmt]


def check_fmt(fmt: str) -> None:
    """Raise ValueError unless `fmt` is a known 8-bit format."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def _check_float(x: torch.Tensor, what: str) -> None:
    if not torch.is_floating_point(x):
        raise ValueError(f"{what} must be a floating-point tensor, got dtype {x.dtype}")


_FINITE_CHUNK = 1 << 20  # elements per partial sum in all_finite


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or inf in floating `x`, without `isfinite(x).all()` on CPU (~2.5 ns per element
    there, more than receiving the bytes): NaN and inf propagate into a sum, so a finite fp32 sum
    proves every element finite; a non-finite sum is either a bad element or an overflow of huge
    finite ones, which the max and min then tell apart exactly. Summed in chunks of 2^20 elements:
    over a whole bf16 tensor torch first widens all of it into one fp32 temporary (a 272 MB bf16
    embedding: 300 ms; by chunks: 34 ms)."""
    if x.device.type != "cpu":
        return bool(torch.isfinite(x).all())
    # bf16 sums accumulate in fp32 inside the kernel and return bf16 (same range as fp32): 2.7x
    # faster than asking for an fp32 result (which widens each chunk first). fp16's range is
    # too small for that (sums of ordinary values overflow), so others sum into fp32.
    acc = None if x.dtype == torch.bfloat16 else torch.float32
    for c in x.reshape(-1).split(_FINITE_CHUNK):
        if not bool(torch.isfinite(c.sum(dtype=acc))) and not (
                bool(torch.isfinite(c.amax())) and bool(torch.isfinite(c.amin()))):
            return False
    return True


def fp8_has_nan(codes: torch.Tensor) -> bool:
    """Any NaN among float8_e4m3fn codes. E4M3FN has no inf and one NaN pattern per sign:
    exponent and mantissa bits all ones (0x7F / 0xFF; the largest finite magnitude is 0x7E = 448),
    so the largest `code & 0x7F` tells. On CPU a uint8 pass instead of widening to fp32 first
    (64M codes: 34 ms vs 660 ms)."""
    return bool(((codes.view(torch.uint8) & 0x7F).max() == 0x7F)) if codes.numel() else False


def _finite_absmax(x32: torch.Tensor, dim: int | tuple[int, ...], what: str) -> torch.Tensor:
    """max |x32| over `dim` (kept), refusing NaN/inf. `amax` propagates NaN and inf into the
    reduced tensor, so checking that small tensor is the same test as checking every element of
    x32 (which costs a full extra pass: `isfinite(x).all()` was a third of a weight's quantize)."""
    absmax = x32.abs().amax(dim=dim, keepdim=True)
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError(f"{what} contains NaN or inf; refusing to quantize it")
    return absmax


def _safe_scale(absmax: torch.Tensor, q: float) -> torch.Tensor:
    """absmax / q, with 1.0 where that is 0 (all-zero rows, or absmax so tiny the division underflows)."""
    scale = absmax / q
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _encode(x32: torch.Tensor, scale: torch.Tensor, fmt: Fmt,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Codes of `x32 / scale` in `fmt` (scale broadcasts against x32), written into `out` if given
    (a code-dtype tensor of x32's shape, e.g. a view into a weight-sync bucket)."""
    q = qmax(fmt)
    y = (x32 / scale).clamp_(-q, q)  # clamp: fp rounding of absmax/q can push |y| just above q
    if fmt == "int8":
        y.round_()
    if out is None:
        return y.to(code_dtype(fmt))
    if out.dtype != code_dtype(fmt) or out.shape != x32.shape:
        raise ValueError(f"out must be {code_dtype(fmt)} {tuple(x32.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    return out.copy_(y)  # the same float -> code conversion as .to()


def quantize_per_channel(w: torch.Tensor, fmt: Fmt,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of a linear weight.

    w: [out, in] (any float dtype) -> (codes [out, in] int8 | float8_e4m3fn, scale [out, 1] fp32),
    with `w ~= codes.float() * scale`. `out=(codes, scale)` writes into those tensors instead (the
    weight sync quantizes straight into its wire buffers) and returns them.
    """
    check_fmt(fmt)
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [out, in], got shape {tuple(w.shape)}")
    _check_float(w, "w")
    w32 = w.to(torch.float32)
    scale = _safe_scale(_finite_absmax(w32, 1, "w"), qmax(fmt))
    if out is None:
        return _encode(w32, scale, fmt), scale
    codes, scale_out = out
    if scale_out.dtype != torch.float32 or scale_out.shape != scale.shape:
        raise ValueError(f"out scale must be float32 {tuple(scale.shape)}, got {scale_out.dtype} "
                         f"{tuple(scale_out.shape)}")
    return _encode(w32, scale, fmt, codes), scale_out.copy_(scale)


def dequantize_per_channel(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_per_channel`: codes [out, in], scale [out, 1] -> [out, in] in `dtype`."""
    if codes.dim() != 2 or scale.shape != (codes.shape[0], 1):
        raise ValueError(
            f"codes must be [out, in] and scale [out, 1]; got {tuple(codes.shape)} and {tuple(scale.shape)}"
        )
    return (codes.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def quantize_per_token(x: torch.Tensor, fmt: Fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization over the last dim.

    x: [..., in] -> (codes [..., in], scale [..., 1] fp32); `x ~= codes.float() * scale`.
    """
    check_fmt(fmt)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    _check_float(x, "x")
    x32 = x.to(torch.float32)
    scale = _safe_scale(_finite_absmax(x32, -1, "x"), qmax(fmt))
    return _encode(x32, scale, fmt), scale


def dequantize_per_token(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_per_token`: codes [..., in], scale [..., 1] -> [..., in]."""
    if scale.shape != (*codes.shape[:-1], 1):
        raise ValueError(f"scale must be {(*codes.shape[:-1], 1)}, got {tuple(scale.shape)}")
    return (codes.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def _block_grid(shape: tuple[int, int], block: int) -> tuple[int, int]:
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    out, inn = shape
    return -(-out // block), -(-inn // block)


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: int) -> torch.Tensor:
    """Per-tile scale [nbo, nbi] -> per-element scale [out, in] (edge tiles cropped)."""
    full = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return full[: shape[0], : shape[1]]


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8-E4M3 quantization with one scale per `block x block` tile.

    w: [out, in] -> (codes float8_e4m3fn [out, in], scale fp32 [ceil(out/block), ceil(in/block)]).
    """
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [out, in], got shape {tuple(w.shape)}")
    nbo, nbi = _block_grid((w.shape[0], w.shape[1]), block)
    _check_float(w, "w")
    w32 = w.to(torch.float32)
    # Pad with zeros to whole tiles; zeros never raise a tile's absmax.
    padded = torch.zeros(nbo * block, nbi * block, dtype=torch.float32, device=w.device)
    padded[: w.shape[0], : w.shape[1]] = w32
    absmax = padded.abs().view(nbo, block, nbi, block).amax(dim=(1, 3))
    if not bool(torch.isfinite(absmax).all()):  # amax propagates NaN/inf (see _finite_absmax)
        raise ValueError("w contains NaN or inf; refusing to quantize it")
    scale = _safe_scale(absmax, FP8_MAX)
    codes = _encode(w32, _expand_blocks(scale, (w.shape[0], w.shape[1]), block), "fp8")
    return codes, scale


def dequantize_fp8_block(
    codes: torch.Tensor, scale: torch.Tensor, block: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_fp8_block`: codes [out, in], scale [ceil(out/b), ceil(in/b)] -> [out, in]."""
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [out, in], got shape {tuple(codes.shape)}")
    shape = (codes.shape[0], codes.shape[1])
    if tuple(scale.shape) != _block_grid(shape, block):
        raise ValueError(
            f"scale must be {_block_grid(shape, block)} for codes {shape} and block {block}, "
            f"got {tuple(scale.shape)}"
        )
    full = _expand_blocks(scale.to(torch.float32), shape, block)
    return (codes.to(torch.float32) * full).to(dtype)
