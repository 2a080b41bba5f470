"""Issue 67 item 7 (export): a Qwen3-MoE as the checkpoints SGLang loads (qurl/models/export8bit.py).

Per-expert HF names at every format (`mlp.experts.e.{gate,up,down}_proj.weight`, with
`weight_scale` [rows, 1] or `weight_scale_inv` [ceil(rows/128), ceil(cols/128)]), the router in
bf16, config.json's quantization_config; read back, every expert is within its format's rounding of
the (UAQ-scaled) weight; and the exported codes are the very codes the engines' sync sends fused
(`w13_weight`[e] = [gate codes; up codes]).
"""
from __future__ import annotations

import json

import pytest
import torch

from qurl.models.export8bit import export_8bit, read_8bit
from qurl.models.hf import build_model, read_state_dict
from qurl.quant.named import engine_chunks
from qurl.quant.uaq import apply_uaq

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
S = 1.5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("moeexp") / "m", "tiny-qwen3-moe", overrides=TINY)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_block", "bf16"])
def test_moe_export_per_expert_names_and_round_trip(tmp_path, tiny, fmt):
    out = export_8bit(tiny, tmp_path / fmt, fmt, uaq_scale=S)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and ("quantization_config" in config) == (fmt != "bf16")
    raw = read_state_dict(out)
    learner = apply_uaq(read_state_dict(tiny), S)
    p = "model.layers.1.mlp."
    assert raw[p + "gate.weight"].dtype == torch.bfloat16  # the router: full precision
    assert not any("w13" in n or "gate_up_proj" in n for n in raw)
    if fmt == "bf16":
        assert raw.keys() == learner.keys()
        assert raw[p + "experts.3.up_proj.weight"].dtype == torch.bfloat16
        return
    scale = "weight_scale_inv" if fmt == "fp8_block" else "weight_scale"
    want = {"gate": (32, 64), "up": (32, 64), "down": (64, 32)}
    for e in range(4):
        for proj, shape in want.items():
            name = f"{p}experts.{e}.{proj}_proj.weight"
            assert raw[name].dtype == (torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
            assert tuple(raw[name].shape) == shape
            s = raw[name[: -len("weight")] + scale]
            assert tuple(s.shape) == ((1, 1) if fmt == "fp8_block" else (shape[0], 1))
    back, _ = read_8bit(out)
    assert back.keys() == learner.keys()
    rel = 2 ** -4 if fmt != "int8" else 0.5 / 127 * 1.0001
    for e in range(4):
        name = f"{p}experts.{e}.down_proj.weight"
        w = learner[name]
        bound = w.abs().amax(dim=1, keepdim=True) * rel + 1e-6
        assert bool(((back[name] - w).abs() <= bound).all()), name
    # the sync's fused codes are the checkpoint's, expert by expert
    fused = dict(engine_chunks(learner.items(), fmt))
    w13 = fused[p + "experts.w13_weight"]
    for e in range(4):
        cat = torch.cat([raw[f"{p}experts.{e}.gate_proj.weight"], raw[f"{p}experts.{e}.up_proj.weight"]])
        assert torch.equal(w13[e].view(torch.uint8), cat.view(torch.uint8))
