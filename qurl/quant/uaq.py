"""Update-aware quantization (UAQ): invariant scaling of norm-fed linears, applied once before training.

Why: one RL step moves a weight by ~lr (1e-7..1e-6 under Adam, whose step size barely depends on the
gradient's scale), far below the 8-bit rounding step `absmax/127` of its row, so the quantized rollout
policy hardly ever sees an update. UAQ shrinks the weights the quantizer sees without changing the
function: for a linear W fed by an RMSNorm with gain g,

    W · (g ⊙ n(x)) = (W / s) · ((s·g) ⊙ n(x))

so dividing W by s and multiplying g by s leaves the network identical in exact arithmetic. The
per-row scale shrinks by s, the quantization grid with it (the codes do not move), while Adam's
update keeps its absolute size ~lr. Measured in grid steps the update grows by ≈ s, and so does the
share of codes that flip at each sync (see qurl.quant.flips).

Pairs scaled in each decoder layer N of a HF Qwen2/Llama state dict:
- `model.layers.N.input_layernorm.weight` × s  with  self_attn.{q,k,v}_proj.weight ÷ s
- `model.layers.N.post_attention_layernorm.weight` × s  with  mlp.{gate,up}_proj.weight ÷ s
Biases (Qwen2's q/k/v biases are added after the matmul), o_proj, down_proj, embed_tokens, lm_head
and the final norm are untouched.

Invariants and limits:
- `apply_uaq` returns a new dict; the input mapping and its tensors are never modified.
- Arithmetic is done in fp32 and cast back to each tensor's dtype, so in bf16 the function is
  preserved only up to bf16 rounding of the scaled tensors.
- Only norms of the form `g ⊙ n(x)` (Qwen2RMSNorm, LlamaRMSNorm, Qwen3RMSNorm) are supported.
  Gemma-style `(1 + g) ⊙ n(x)` norms would need `g' = s·(1+g) − 1`. A layer whose norm lacks any
  of the linears it feeds (e.g. MoE experts, fused qkv) is refused, since scaling such a norm
  would change the function.
- Qwen3's q/k norms (RMSNorm of each head of q_proj's and k_proj's *outputs*) are left alone and
  need nothing: UAQ scales the *input* of q_proj/k_proj (the input norm's gain, × s) and their
  weights (÷ s), so q = (W/s)(s·x) and k are what they were — in exact arithmetic, and up to
  fp32 rounding of the two products — and so are their norms. (A refusal here used to claim
  otherwise.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import torch

DEFAULT_S = 1.5

_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")
_GROUPS = (("input_layernorm", _ATTN), ("post_attention_layernorm", _MLP))
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_SCALED_RE = re.compile(r"^model\.layers\.\d+\.(?:self_attn\.(?:q|k|v)_proj|mlp\.(?:gate|up)_proj)\.weight$")


def uaq_scaled(name: str) -> bool:
    """True for the linear weights UAQ divides by s (q/k/v and gate/up of a decoder layer)."""
    return _SCALED_RE.match(name) is not None


def uaq_pairs(names: Iterable[str]) -> list[tuple[str, list[str]]]:
    """(norm name, [linear weight names it feeds]) for every norm/linear group present in `names`.

    Lists only names that exist; a group appears if its norm or any of its linears does, so a
    partial group is visible (apply_uaq refuses it). Ordered by layer, attention group first.
    """
    present = set(names)
    layers = sorted({int(m.group(1)) for n in present if (m := _LAYER_RE.match(n))})
    pairs: list[tuple[str, list[str]]] = []
    for i in layers:
        for norm, linears in _GROUPS:
            norm_name = f"model.layers.{i}.{norm}.weight"
            lin = [f"model.layers.{i}.{p}.weight" for p in linears]
            lin = [n for n in lin if n in present]
            if norm_name in present or lin:
                pairs.append((norm_name, lin))
    return pairs


def apply_uaq(state: Mapping[str, torch.Tensor], s: float = DEFAULT_S) -> dict[str, torch.Tensor]:
    """Invariant scaling of a HF Qwen2/Qwen3/Llama state dict by `s` (> 0); returns a new dict.

    Scaled entries are new tensors; all other entries are the input tensors themselves (shared).
    """
    if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
        raise ValueError(f"s must be a finite number > 0, got {s!r}")
    out = dict(state)
    for norm_name, linears in uaq_pairs(state):
        expected = len(_ATTN) if norm_name.endswith("input_layernorm.weight") else len(_MLP)
        if norm_name not in state:
            raise ValueError(f"UAQ: {linears[0]} has no feeding norm {norm_name!r}")
        if len(linears) != expected:
            raise ValueError(f"UAQ: {norm_name} feeds {expected} linears but only {linears} are present")
        out[norm_name] = _scaled(state[norm_name], s, divide=False)
        for name in linears:
            out[name] = _scaled(state[name], s, divide=True)
    return out


def _scaled(t: torch.Tensor, s: float, *, divide: bool) -> torch.Tensor:
    """t ÷ s or t × s in fp32 (fp64 for fp64 tensors), returned in t's dtype as a new tensor."""
    work = torch.float64 if t.dtype == torch.float64 else torch.float32
    x = t.detach().to(work)
    return (x / s if divide else x * s).to(t.dtype)
