"""INT4 weight-only group-wise quantization (W4A16): the study's declared low-bit stress format.

8-bit rollout on the tiny CPU model hardly perturbs the policy (KL(behav‖prox) ~1e-4 with FP8),
so the ablation also offers a 4-bit weight format, the kind AWQ/GPTQ checkpoints use: every row of a
linear weight `w: [out, in]` is cut into groups of `group` consecutive input columns (128 by
default, the common AWQ/GPTQ choice), and each group gets its own fp32 scale

    scale[o, g] = absmax(w[o, g*group:(g+1)*group]) / 7,   codes = round_half_even(w / scale) in [-7, 7]

so `w ~= codes * scale` with an error of at most scale/2 per element. Codes are symmetric (-8 is
never produced) and held one per int8 (not packed two to a byte: the CPU engine dequantizes them
anyway). Activations stay in full precision: the engine's linear dequantizes the weight and runs a
float matmul (qurl.engines.qlinear.Int4Linear).

Invariants, as for the 8-bit formats (qurl.quant.formats): scales fp32, finite, > 0 (an all-zero
group gets scale 1 and zero codes); non-finite input is refused; `in` must be a multiple of `group`
(a ValueError naming the shape otherwise); arithmetic in fp32 whatever the input dtype.

Group size per weight: `int4_group(in)` = gcd(in, 128), so 128 wherever it tiles the row and the
largest power-of-two divisor below it otherwise (a real model's hidden 576 = 9 x 64 gets groups
of 64, where 128 cannot tile). The group is implied by the shapes (in // scale columns), so the
dequantizer and every check read it from the scale.
"""
from __future__ import annotations

import math

import torch

INT4_MAX = 7
INT4_GROUP = 128


def int4_group(cols: int) -> int:
    """The group size for a weight with `cols` input columns: gcd(cols, 128) (module docstring)."""
    return math.gcd(int(cols), INT4_GROUP)


def _check(w: torch.Tensor, group: int) -> None:
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [out, in], got shape {tuple(w.shape)}")
    if not torch.is_floating_point(w):
        raise ValueError(f"w must be a floating-point tensor, got dtype {w.dtype}")
    if group < 1 or w.shape[1] % group:
        raise ValueError(f"int4 groups of {group} columns do not tile w {tuple(w.shape)}")


def quantize_int4_groups(w: torch.Tensor, group: int = INT4_GROUP,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] float -> (codes int8 [out, in] in [-7, 7], scale fp32 [out, in // group]).
    `out=(codes, scale)` writes into those tensors (shapes/dtypes as returned) instead."""
    _check(w, group)
    rows, cols = w.shape
    g = w.to(torch.float32).reshape(rows, cols // group, group)
    absmax = g.abs().amax(dim=2)  # amax propagates NaN/inf
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError("w contains NaN or inf; refusing to quantize it")
    scale = absmax / INT4_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (g / scale.unsqueeze(2)).clamp_(-INT4_MAX, INT4_MAX).round_().reshape(rows, cols)
    if out is None:
        return codes.to(torch.int8), scale
    c_out, s_out = out
    if c_out.dtype != torch.int8 or c_out.shape != w.shape or s_out.dtype != torch.float32 \
            or s_out.shape != scale.shape:
        raise ValueError(f"out must be int8 {tuple(w.shape)} and float32 {tuple(scale.shape)}, "
                         f"got {c_out.dtype} {tuple(c_out.shape)} and {s_out.dtype} "
                         f"{tuple(s_out.shape)}")
    return c_out.copy_(codes), s_out.copy_(scale)


def dequantize_int4_groups(codes: torch.Tensor, scale: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_int4_groups`: codes [out, in], scale [out, in // group] -> [out, in]."""
    if codes.dim() != 2 or scale.dim() != 2 or scale.shape[0] != codes.shape[0] \
            or scale.shape[1] == 0 or codes.shape[1] % scale.shape[1]:
        raise ValueError(f"codes [out, in] and scale [out, in // group] do not match: "
                         f"{tuple(codes.shape)} and {tuple(scale.shape)}")
    group = codes.shape[1] // scale.shape[1]
    w = codes.to(torch.float32) * scale.to(torch.float32).repeat_interleave(group, dim=1)
    return w.to(dtype)


def check_int4_codes(codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int],
                     group: int = INT4_GROUP, name: str = "weight") -> None:
    """Raise ValueError (naming `name`) unless codes/scale are int4 codes of a `shape` weight."""
    if codes.dtype != torch.int8 or tuple(codes.shape) != tuple(shape):
        raise ValueError(f"{name}: expected int4 codes torch.int8 {tuple(shape)}, "
                         f"got {codes.dtype} {tuple(codes.shape)}")
    want = (shape[0], shape[1] // group)
    if tuple(scale.shape) != want or not torch.is_floating_point(scale):
        raise ValueError(f"{name}_scale: expected float group scales {want}, "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ValueError(f"{name}_scale: scales must be finite and > 0")
    if codes.numel() and (int(codes.max()) > INT4_MAX or int(codes.min()) < -INT4_MAX):
        raise ValueError(f"{name}: int4 codes outside [-{INT4_MAX}, {INT4_MAX}]")
