"""The HF <-> SGLang parameter layout qurl's in-server delta / verify code uses
(qurl/engines/sglang/inside/layout.py), and the adapter's parsing of the server's refusals
(qurl/engines/sglang/verified_sync.py): closed-form expectations, no server."""
from __future__ import annotations

import pytest
import torch

from qurl.engines.sglang.inside.layout import (HEADER, hf_rows, hf_view, json_chunk, part_rows,
                                               read_json_chunk, sglang_name)
from qurl.engines.sglang.verified_sync import (apply_to_kept, chunk_meta, header_chunk,
                                               is_stale_refusal, parse_mismatch, verify_chunk)
from qurl.weights.delta import apply_named, encode_named


def test_names_map_to_fused_parameters_and_parts():
    L = "model.layers.3."
    assert sglang_name(L + "self_attn.q_proj.weight") == (L + "self_attn.qkv_proj.weight", 0)
    assert sglang_name(L + "self_attn.k_proj.weight_scale") == \
        (L + "self_attn.qkv_proj.weight_scale", 1)
    assert sglang_name(L + "self_attn.v_proj.bias") == (L + "self_attn.qkv_proj.bias", 2)
    assert sglang_name(L + "mlp.gate_proj.weight_scale_inv") == \
        (L + "mlp.gate_up_proj.weight_scale_inv", 0)
    assert sglang_name(L + "mlp.up_proj.weight") == (L + "mlp.gate_up_proj.weight", 1)
    for same in (L + "self_attn.o_proj.weight", L + "mlp.down_proj.weight_scale",
                 "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert sglang_name(same) == (same, None)


def test_part_rows_for_weights_and_tile_scales():
    # q 256 rows, k and v 64 each (Qwen2 GQA): weights / per-channel scales / biases
    assert part_rows([256, 64, 64], 384) == [(0, 256), (256, 64), (320, 64)]
    # block-FP8 scales: one row per 128-row tile, each part a whole number of tiles
    assert part_rows([256, 128, 128], 4) == [(0, 2), (2, 1), (3, 1)]
    assert part_rows([896, 896], 14) == [(0, 7), (7, 7)]
    with pytest.raises(ValueError):
        part_rows([256, 64, 64], 3)  # 64-row parts are not whole 128-row tiles
    with pytest.raises(ValueError):
        part_rows([256, 64, 64], 100)


def test_hf_rows_checks_the_part_size_and_the_bounds():
    assert hf_rows(2, [256, 64, 64], 384, (64, 256)) == (320, 64)
    assert hf_rows(None, None, 128, (100, 16)) == (0, 100)  # padded vocabulary: HF rows first
    with pytest.raises(ValueError, match="has 64 rows"):
        hf_rows(1, [256, 64, 64], 384, (65, 256))
    with pytest.raises(ValueError, match="outside"):
        hf_rows(None, None, 96, (100, 16))


def test_hf_view_is_a_view_of_the_fused_parameter():
    qkv = torch.arange(384 * 4, dtype=torch.int16).reshape(384, 4)
    k = hf_view(qkv, 1, [256, 64, 64], (64, 4))
    assert k.data_ptr() == qkv[256].data_ptr() and k.is_contiguous()
    assert int(k[0, 0]) == 256 * 4 and int(k[-1, -1]) == 320 * 4 - 1
    k[3, 2] = -1  # writing the view writes the parameter in place
    assert int(qkv[259, 2]) == -1
    # W8A8: after qurl's restore the weight is the [out, in] view of the transposed storage
    stored = torch.arange(12, dtype=torch.int8).reshape(3, 4)  # [out, in] as loaded
    held = stored.t()  # what SGLang computes with, [in, out]
    assert hf_view(held.t(), None, None, (3, 4)).data_ptr() == stored.data_ptr()
    # a scale held [out] for an HF [out, 1]; a padded embedding
    scale = torch.arange(6, dtype=torch.float32)
    assert tuple(hf_view(scale, None, None, (6, 1)).shape) == (6, 1)
    emb = torch.zeros(128, 8, dtype=torch.bfloat16)
    assert tuple(hf_view(emb, None, None, (100, 8)).shape) == (100, 8)
    with pytest.raises(ValueError, match="do not hold"):
        hf_view(emb, None, None, (100, 9))


def test_control_chunks_round_trip():
    meta = {"a.weight": ([3, 4], "int8"), "a.weight_scale": ([3, 1], "float32")}
    name, t = header_chunk(7, (6, "ab12"), meta)
    assert name == HEADER and t.dtype == torch.uint8 and t.dim() == 1
    assert read_json_chunk(t) == {"version": 7, "base": [6, "ab12"],
                                  "shapes": {"a.weight": [3, 4], "a.weight_scale": [3, 1]}}
    _, v = verify_chunk(7, {"a.weight": "00ff"}, meta)
    assert read_json_chunk(v) == {"version": 7, "digests": {"a.weight": ["00ff", [3, 4], "int8"]}}
    assert read_json_chunk(json_chunk([1, "x"])) == [1, "x"]
    assert chunk_meta([("w", torch.zeros(2, 3, dtype=torch.float8_e4m3fn))]) == \
        {"w": ([2, 3], "float8_e4m3fn")}


def test_refusal_messages_parse():
    msg = ("Failed to update parameter online: qurl-mismatch:[\"m.q_proj.weight\", \"m.norm\"] "
           "(v3: 2 of 9 tensors differ from the learner's). The full weights of the ...")
    assert parse_mismatch(msg) == ["m.q_proj.weight", "m.norm"]
    assert parse_mismatch("Failed to update parameter online: KeyError 'x'") is None
    assert is_stale_refusal("Failed ...: qurl-stale-base: this server holds nothing verified")
    assert not is_stale_refusal("must run between begin_weight_update() and end_weight_update()")


def test_kept_copy_follows_deltas_in_place():
    g = torch.Generator().manual_seed(0)
    v0 = {"c": torch.randint(-127, 128, (300, 70), generator=g, dtype=torch.int8),
          "s": torch.rand(300, 1, generator=g)}
    v1 = {"c": v0["c"].clone(), "s": v0["s"] * 1.5}
    v1["c"][5, 7], v1["c"][299, 69] = 1, -1
    wire, st = encode_named(v0, list(v1.items()))
    assert st.delta == 1 and st.full == 1  # the codes as a delta, every scale changed: whole
    kept = {n: t.clone() for n, t in v0.items()}
    ptr = kept["c"].data_ptr()
    apply_to_kept(kept, wire)
    assert kept["c"].data_ptr() == ptr  # in place
    for n in v1:
        assert torch.equal(kept[n], v1[n]) and torch.equal(kept[n], apply_named(v0, wire)[n])


def test_verification_hashes_every_copy_of_a_tied_embedding():
    """An SGLang model whose lm_head ties to the embedding but holds storage of its own: the
    in-server check hashes both regions, so a stale or corrupted head cannot hide behind a
    correct embedding (issue 60: every view of every parameter)."""
    from types import SimpleNamespace

    from qurl.engines.sglang.inside.apply import held_digests
    from qurl.weights.digest import tensor_digest

    vocab, pad, hidden = 10, 64, 4
    model = torch.nn.Module()
    model.config = SimpleNamespace(tie_word_embeddings=True)
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(pad, hidden)
    model.lm_head = torch.nn.Linear(hidden, pad, bias=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    hf = model.model.embed_tokens.weight.detach()[:vocab].clone()
    spec = {"model.embed_tokens.weight": [tensor_digest(hf), [vocab, hidden], "float32"]}
    assert held_digests(model, spec) == {"model.embed_tokens.weight": tensor_digest(hf)}
    with torch.no_grad():
        model.lm_head.weight[3, 1] += 1.0  # the head's copy only
    assert held_digests(model, spec) == {"model.embed_tokens.weight": "views-differ"}
