"""Issue 67 item 2: UAQ over a Qwen3-MoE layer's MLP side (qurl/quant/uaq.py).

post_attention_layernorm × s with the router and every expert's gate/up ÷ s (the dense rule's
direction; the module docstring says why not the issue's "norm ÷ s, router × s"). In float64 the
model's logits and every layer's router logits are unchanged (ATOL: float64 rounding of the scaled
tensors, measured ~1e-15), from per-expert names (the checkpoint's and the learner's) and from
transformers 5's fused `gate_up_proj` alike; down_proj is untouched; a layer missing one expert's
up, or its router, is refused.
"""
from __future__ import annotations

import pytest
import torch
from tiny_hf import build_moe

from qurl.models import moe
from qurl.quant.uaq import apply_uaq, uaq_scaled

ATOL = 1e-10
S = 1.5


@pytest.fixture(scope="module")
def model():
    return build_moe().double()


def _run(model, state) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.load_state_dict(state)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    return out.logits, list(out.router_logits)


@pytest.mark.parametrize("form", ["fused", "per_expert"])
def test_moe_uaq_is_invariant_in_float64(model, form):
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    logits, routers = _run(model, base)
    src = base if form == "fused" else moe.per_expert(base)
    scaled = apply_uaq(src, S)
    p = "model.layers.1."
    assert torch.allclose(scaled[p + "post_attention_layernorm.weight"],
                          src[p + "post_attention_layernorm.weight"] * S)
    assert torch.allclose(scaled[p + "mlp.gate.weight"], src[p + "mlp.gate.weight"] / S)
    if form == "per_expert":
        assert torch.allclose(scaled[p + "mlp.experts.7.up_proj.weight"],
                              src[p + "mlp.experts.7.up_proj.weight"] / S)
        assert scaled[p + "mlp.experts.7.down_proj.weight"] is src[p + "mlp.experts.7.down_proj.weight"]
        scaled = moe.fused(scaled, model.config)
    else:
        assert scaled[p + "mlp.experts.down_proj"] is src[p + "mlp.experts.down_proj"]
    got_logits, got_routers = _run(model, scaled)
    model.load_state_dict(base)
    assert (got_logits - logits).abs().max().item() < ATOL
    for a, b in zip(routers, got_routers):  # the router sees the same logits: the same experts
        assert (a - b).abs().max().item() < ATOL


def test_moe_uaq_refuses_a_partial_layer(model):
    sd = moe.per_expert({k: v.detach() for k, v in model.state_dict().items()})
    missing = dict(sd)
    del missing["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match="post_attention_layernorm"):
        apply_uaq(missing, S)
    no_router = dict(sd)
    del no_router["model.layers.0.mlp.gate.weight"]
    with pytest.raises(ValueError, match="post_attention_layernorm"):
        apply_uaq(no_router, S)


def test_uaq_scaled_names_for_flip_fractions():
    assert uaq_scaled("model.layers.2.mlp.experts.w13_weight")
    assert uaq_scaled("model.layers.2.mlp.experts.5.gate_proj.weight")
    assert uaq_scaled("model.layers.2.mlp.gate.weight")
    assert not uaq_scaled("model.layers.2.mlp.experts.w2_weight")
    assert not uaq_scaled("model.layers.2.mlp.experts.5.down_proj.weight")
