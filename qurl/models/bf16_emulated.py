"""bf16 autocast on a CPU without bf16 matmul hardware, at fp32 speed.

`torch.autocast("cpu", dtype=torch.bfloat16)` runs the matmul-like ops (linear, matmul, attention)
in bf16: their floating inputs are rounded to bf16 (8 significant bits, round to nearest even), the
products are summed in fp32, and the result is rounded to bf16. On CPUs with AVX512-BF16 or AMX
oneDNN does that in hardware, about 2x faster than fp32. On a CPU without them (e.g. the AMD EPYC
VMs) the same ops fall back to emulated kernels ~9x slower than fp32 (measured, 2048×576 by
576×1536 on one thread: 0.49 s against 0.052 s).

The rounding is what changes training, not the kernel: a product of two bf16 numbers is exact in
fp32, so a bf16 matmul is an fp32 matmul of bf16-rounded inputs, rounded once at the end. This
module computes exactly that with fp32 kernels:

    linear(x, W, b)   ->  bf16( fp32_linear(r(x), r(W), r(b)) ),     r(t) = fp32(bf16(t))
    sdpa(q, k, v, M)  ->  bf16( r(P) r(v) / rowsum(P) ),  P = exp(S - rowmax S),
                          S = scale · r(q) r(k)ᵀ + M   (M: 0 / −inf for a bool mask, r(M) added)

Autograd differentiates through the two casts the way autocast's casts are differentiated: the
gradient reaching x and W is rounded to bf16 (the backward of r), the one leaving the output is
the bf16 gradient of a bf16 tensor. For a linear, what differs from the hardware kernel is only
the order in which each dot product's fp32 terms are summed (a last-bit difference), so a run
reproduces an autocast run's numbers to bf16 precision, not bit for bit
(tests/test_bf16_emulated.py compares linear, its gradients, SDPA and a Llama forward against
real autocast).

The attention line follows PyTorch's CPU flash-attention kernel for bf16 (one key block at these
lengths): scores and the softmax in fp32, the unnormalised probabilities rounded to bf16 for the
product with v, the division by the row sum last. A row with every key masked gives 0, as there.
Checked against real bf16 SDPA: ~90-97% of outputs bitwise equal, relative error 5-8e-4 (an fp32
SDPA rounded once: 2.8e-3).

Why it matters here: the SmolLM2 warm start (qurl/models/warmstart.py) trains fp32 master weights
at lr 3e-5, while the forward under autocast sees them rounded to bf16. AdamW moves each weight
by about the learning rate, far below the bf16 spacing of SmolLM2's weights (median |w| 0.11,
spacing ~5e-4): a step of 1.5e-5 (the first, in warm-up) changes the bf16 value of 6.4% of the
weights, one of 3e-5 11%. Most steps never reach the forward, and the fine-tune moves much less
than the same run in fp32 (seed 4 after 20 steps: loss 0.072 under autocast, 0.0097 in fp32;
docs/study/smollm2_regime.md). A CPU without native bf16 therefore has to emulate the rounding,
not skip it, to build the same kind of model.

Scope: `torch.nn.functional.linear` and `scaled_dot_product_attention` only, the two ops through
which a transformers Llama/Qwen2 forward (sdpa attention) reaches autocast's bf16 list. Plain
`matmul` is left alone on purpose: the rotary embedding's is run with autocast disabled, which an
emulation could not see. Embedding, norms and the loss stay fp32 as they do under autocast.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _round(t: Any) -> Any:
    """A floating tensor rounded to bf16 and held in fp32 (others unchanged)."""
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.to(torch.bfloat16).to(torch.float32)
    return t


def sdpa_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """Scaled dot-product attention as CPU bf16 autocast computes it (module docstring).
    q: [..., Hq, L, D], k/v: [..., Hk, S, D] (Hk = Hq, or divides it with enable_gqa) -> bf16
    [..., Hq, L, D]."""
    if dropout_p:
        raise ValueError("emulated bf16 attention has no dropout (the warm start uses none)")
    q, k, v = _round(q), _round(k), _round(v)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = (s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
             else s + _round(attn_mask))
    top = s.amax(-1, keepdim=True)
    empty = torch.isneginf(top)  # every key masked: the kernel writes 0
    p = torch.exp(s - top.masked_fill(empty, 0.0))
    out = (_round(p) @ v) / p.sum(-1, keepdim=True).masked_fill(empty, 1.0)
    return out.to(torch.bfloat16)


class EmulatedBf16Autocast(TorchFunctionMode):
    """Context manager: inside it, linear and sdpa compute as under CPU bf16 autocast (above)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            args = tuple(_round(a) for a in args)
            kwargs = {k: _round(v) for k, v in kwargs.items()}
            return func(*args, **kwargs).to(torch.bfloat16)
        if func is F.scaled_dot_product_attention:
            return sdpa_bf16(*args, **kwargs)
        return func(*args, **kwargs)
