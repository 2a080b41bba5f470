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

Pairs scaled in each decoder layer N of a HF Qwen2/Qwen3/Llama/Qwen3-MoE state dict:
- `model.layers.N.input_layernorm.weight` × s  with  self_attn.{q,k,v}_proj.weight ÷ s
- `model.layers.N.post_attention_layernorm.weight` × s  with  mlp.{gate,up}_proj.weight ÷ s (dense),
  or, in a Qwen3-MoE layer, with everything that norm feeds: the router `mlp.gate.weight` ÷ s and
  every expert's gate and up (`mlp.experts.e.{gate,up}_proj.weight`, or transformers 5's fused
  `mlp.experts.gate_up_proj` [E, 2I, H]) ÷ s. The router's logits W_r x are then unchanged, so the
  softmax, the top-k and the weights are too; each expert's input is the same normed x, so its
  gate and up outputs are unchanged, and down_proj (fed by silu(gate) ⊙ up) needs nothing.
Biases (Qwen2's q/k/v biases are added after the matmul), o_proj, down_proj, embed_tokens, lm_head
and the final norm are untouched.

Direction on the MoE side. Issue 67 wrote it as "norm ÷ s, router and gate/up × s"; that is the
same invariance with s -> 1/s, and it would grow the expert weights and their 8-bit grid by s,
shrinking each update in grid steps, the opposite of what UAQ is for. One `s` means one thing
here for attention, dense MLPs and experts: the norm × s, the linears it feeds ÷ s.

Invariants and limits:
- `apply_uaq` returns a new dict; the input mapping and its tensors are never modified.
- Arithmetic is done in fp32 and cast back to each tensor's dtype, so in bf16 the function is
  preserved only up to bf16 rounding of the scaled tensors (the router too: it stays in full
  precision, so its ÷ s is rounded like any master weight, never quantized).
- Only norms of the form `g ⊙ n(x)` (Qwen2RMSNorm, LlamaRMSNorm, Qwen3RMSNorm) are supported.
  Gemma-style `(1 + g) ⊙ n(x)` norms would need `g' = s·(1+g) − 1`. A layer whose norm lacks any
  of the linears it feeds (fused qkv, a MoE layer missing its router or one expert's gate or up)
  is refused, since scaling such a norm would change the function.
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
_SCALED_RE = re.compile(
    r"^model\.layers\.\d+\.(?:(?:self_attn\.(?:q|k|v)_proj|mlp\.(?:experts\.\d+\.)?(?:gate|up)_proj|mlp\.gate)"
    r"\.weight|mlp\.experts\.(?:gate_up_proj|w13_weight))$")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up)_proj\.weight$")


def uaq_scaled(name: str) -> bool:
    """True for the weights UAQ divides by s: q/k/v and gate/up of a decoder layer, and in a MoE
    layer the router and every expert's gate/up (per expert, fused `gate_up_proj`, or the
    engines' `w13_weight`)."""
    return _SCALED_RE.match(name) is not None


def uaq_pairs(names: Iterable[str]) -> list[tuple[str, list[str]]]:
    """(norm name, [linear weight names it feeds]) for every norm/linear group present in `names`.

    Lists only names that exist; a group appears if its norm or any of its linears does, so a
    partial group is visible (apply_uaq refuses it). Ordered by layer, attention group first.
    """
    present = set(names)
    layers = sorted({int(m.group(1)) for n in present if (m := _LAYER_RE.match(n))})
    experts: dict[int, set[int]] = {}
    for n in present:
        if m := _EXPERT_RE.match(n):
            experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    pairs: list[tuple[str, list[str]]] = []
    for i in layers:
        for norm, linears in _GROUPS:
            norm_name = f"model.layers.{i}.{norm}.weight"
            lin = [f"model.layers.{i}.{p}.weight" for p in linears]
            if linears is _MLP and f"model.layers.{i}.mlp.gate.weight" in present:  # MoE layer
                p = f"model.layers.{i}.mlp."
                lin = [p + "gate.weight", p + "experts.gate_up_proj"] + [
                    f"{p}experts.{e}.{w}_proj.weight"
                    for e in range(1 + max(experts.get(i, {-1}))) for w in ("gate", "up")]
            lin = [n for n in lin if n in present]
            if norm_name in present or lin:
                pairs.append((norm_name, lin))
    return pairs


def _expected(norm_name: str, linears: list[str], present: Mapping[str, torch.Tensor]) -> int:
    """How many linears `norm_name` feeds: 3 (attention), 2 (dense MLP), or in a MoE layer the
    router plus the fused experts (1) or 2 per expert (the count the router's rows give)."""
    if norm_name.endswith("input_layernorm.weight"):
        return len(_ATTN)
    router = norm_name.replace("post_attention_layernorm", "mlp.gate")
    if router not in present:
        return len(_MLP)
    if router.replace("gate.weight", "experts.gate_up_proj") in linears:
        return 2
    return 1 + 2 * int(present[router].shape[0])


def apply_uaq(state: Mapping[str, torch.Tensor], s: float = DEFAULT_S) -> dict[str, torch.Tensor]:
    """Invariant scaling of a HF Qwen2/Qwen3/Llama state dict by `s` (> 0); returns a new dict.

    Scaled entries are new tensors; all other entries are the input tensors themselves (shared).
    """
    if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
        raise ValueError(f"s must be a finite number > 0, got {s!r}")
    out = dict(state)
    for norm_name, linears in uaq_pairs(state):
        expected = _expected(norm_name, linears, state)
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
