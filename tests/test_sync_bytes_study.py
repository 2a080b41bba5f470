"""qurl.research.studies.sync_bytes: bytes of a sync by tensor kind, counted by hand on a small Llama layout."""
import torch

from qurl.research.studies.sync_bytes import bytes_by_kind, kind_of, table
from qurl.weights.publish import WeightSync

V, H, I = 64, 16, 24  # vocab, hidden, intermediate; one decoder layer, tied embeddings


def _state():
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
              p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (8, H),
              p + "self_attn.v_proj.weight": (8, H), p + "self_attn.o_proj.weight": (H, H),
              p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
              p + "mlp.down_proj.weight": (H, I)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _sync(precision, wire):
    chunks, _ = WeightSync(precision, wire_dtype=wire).quantize(iter(_state().items()))
    return bytes_by_kind(chunks)


def test_int8_sync_by_kind_counts_by_hand():
    linear = H * H * 2 + 8 * H * 2 + I * H * 2 + H * I  # weights of the 7 linears
    rows_out = H + 8 + 8 + H + I + I + H  # one fp32 scale per output row
    for wire, width in ((None, 4), (torch.bfloat16, 2)):
        r = _sync("int8", wire)
        assert r["linear codes"]["bytes"] == linear and r["linear codes"]["dtypes"] == {"int8"}
        assert r["linear scales"]["bytes"] == 4 * rows_out
        assert r["embedding"]["bytes"] == width * V * H
        assert r["norms"]["bytes"] == width * 3 * H
        assert r["total"]["bytes"] == linear + 4 * rows_out + width * (V * H + 3 * H)
        assert "other" not in r and "lm_head" not in r


def test_bf16_sync_sends_linears_full_precision():
    r = _sync("bf16", torch.bfloat16)
    assert "linear codes" not in r and r["other"]["dtypes"] == {"bfloat16"}
    assert "| total |" in table(r, "kind")


def test_kinds():
    codes = torch.zeros(2, 2, dtype=torch.int8)
    assert kind_of("model.layers.3.mlp.down_proj.weight", codes) == "linear codes"
    assert kind_of("model.layers.3.mlp.down_proj.weight_scale_inv", torch.ones(1, 1)) == "linear scales"
    assert kind_of("lm_head.weight", torch.ones(1)) == "lm_head"
    assert kind_of("model.layers.0.self_attn.q_proj.bias", torch.ones(1)) == "other"
