"""Which slice of each HF tensor an SGLang TP rank holds (qurl/engines/sglang/inside/tp_cut.py): boxes
worked by hand from SGLang 0.5.23's loaders for small configs, no server.

The main config: 4 query heads of 2, ONE key/value head (so at TP 2 the k/v head is replicated on
both ranks: `num_kv_head_replicas` = 2), hidden 8, SwiGLU 6, vocabulary 100 (padded to 128 rows,
64 per rank: rank 0 holds rows 0..63, rank 1 rows 64..99 then 28 zero rows)."""
from __future__ import annotations

import pytest
import torch

from qurl.engines.sglang.inside.tp_cut import (Box, Layout, cpu_padding, local_positions,
                                               rank_digests, shard_box, slice_shape, take,
                                               vocab_rows)
from qurl.weights.delta import changed_positions
from qurl.weights.digest import tensor_digest

L0 = "model.layers.0."
MQA = Layout(heads=4, kv_heads=1)
# HF name -> (shape, [box of rank 0, box of rank 1]) at TP 2, by hand
TP2 = {
    L0 + "self_attn.q_proj.weight": ((8, 8), [Box((0, 4)), Box((4, 4))]),
    L0 + "self_attn.q_proj.bias": ((8,), [Box((0, 4)), Box((4, 4))]),
    L0 + "self_attn.q_proj.weight_scale": ((8, 1), [Box((0, 4)), Box((4, 4))]),
    # one kv head, two ranks: both hold it whole
    L0 + "self_attn.k_proj.weight": ((2, 8), [Box((0, 2)), Box((0, 2))]),
    L0 + "self_attn.v_proj.bias": ((2,), [Box((0, 2)), Box((0, 2))]),
    L0 + "self_attn.v_proj.weight_scale": ((2, 1), [Box((0, 2)), Box((0, 2))]),
    # row-parallel: columns cut; the per-channel scale [out, 1] is whole on every rank
    L0 + "self_attn.o_proj.weight": ((8, 8), [Box((0, 8), (0, 4)), Box((0, 8), (4, 4))]),
    L0 + "self_attn.o_proj.weight_scale": ((8, 1), [Box((0, 8)), Box((0, 8))]),
    L0 + "mlp.gate_proj.weight": ((6, 8), [Box((0, 3)), Box((3, 3))]),
    L0 + "mlp.up_proj.weight_scale": ((6, 1), [Box((0, 3)), Box((3, 3))]),
    L0 + "mlp.down_proj.weight": ((8, 6), [Box((0, 8), (0, 3)), Box((0, 8), (3, 3))]),
    L0 + "mlp.down_proj.weight_scale": ((8, 1), [Box((0, 8)), Box((0, 8))]),
    L0 + "input_layernorm.weight": ((8,), [Box((0, 8)), Box((0, 8))]),
    # Qwen3's per-head q/k norm gains (head_dim 2): SGLang 0.5.23 models/qwen3.py builds them as a
    # plain RMSNorm(head_dim), whole on every rank
    L0 + "self_attn.q_norm.weight": ((2,), [Box((0, 2)), Box((0, 2))]),
    L0 + "self_attn.k_norm.weight": ((2,), [Box((0, 2)), Box((0, 2))]),
    "model.norm.weight": ((8,), [Box((0, 8)), Box((0, 8))]),
    "model.embed_tokens.weight": ((100, 8), [Box((0, 64)), Box((64, 36))]),
    "lm_head.weight": ((100, 8), [Box((0, 64)), Box((64, 36))]),
}


@pytest.mark.parametrize("name", sorted(TP2))
def test_tp2_boxes_by_hand(name):
    shape, boxes = TP2[name]
    assert [shard_box(name, shape, r, 2, MQA) for r in range(2)] == boxes


def test_tp1_is_the_whole_tensor_for_any_name():
    for name, (shape, _) in TP2.items():
        assert shard_box(name, shape, 0, 1, None) == Box((0, shape[0]))
    assert shard_box("model.layers.0.mlp.experts.3.w1.weight", (4, 4), 0, 1, None) == Box((0, 4))


def test_kv_heads_more_than_ranks_and_replicated_in_groups():
    k = L0 + "self_attn.k_proj.weight"
    # 4 kv heads of 2 over 2 ranks: 2 heads each
    assert [shard_box(k, (8, 8), r, 2, Layout(4, 4)) for r in range(2)] == \
        [Box((0, 4)), Box((4, 4))]
    # 2 kv heads over 4 ranks: each head on 2 ranks (SGLang: shard_id = rank // replicas)
    assert [shard_box(k, (4, 8), r, 4, Layout(8, 2)).rows for r in range(4)] == \
        [(0, 2), (0, 2), (2, 2), (2, 2)]


def test_block_fp8_tile_scales_follow_their_weight():
    # [out/128, in/128] tiles: column-parallel cut rows, row-parallel cut columns
    q, o = L0 + "self_attn.q_proj.weight_scale_inv", L0 + "self_attn.o_proj.weight_scale_inv"
    assert [shard_box(q, (4, 2), r, 2, Layout(4, 4)) for r in range(2)] == \
        [Box((0, 2)), Box((2, 2))]
    assert [shard_box(o, (2, 4), r, 2, Layout(4, 4)) for r in range(2)] == \
        [Box((0, 2), (0, 2)), Box((0, 2), (2, 2))]


def test_vocab_padding_and_split():
    assert [vocab_rows(100, r, 2) for r in range(2)] == [(0, 64), (64, 36)]
    assert [vocab_rows(130, r, 2) for r in range(2)] == [(0, 96), (96, 34)]  # 192 padded
    # pad(100, 64) = 128 is not a multiple of 3: SGLang pads to 64*3 = 192, 64 per rank
    assert [vocab_rows(100, r, 3) for r in range(3)] == [(0, 64), (64, 36), (100, 0)]
    assert vocab_rows(49152, 1, 2) == (24576, 24576)
    assert slice_shape((100, 8), Box((100, 0))) == (0, 8)


def test_cuts_qurl_cannot_map_are_refused():
    with pytest.raises(ValueError, match="no TP layout"):
        shard_box("model.layers.0.mlp.experts.3.w1.weight", (4, 4), 0, 2, MQA)
    with pytest.raises(ValueError, match="3 heads"):
        shard_box(L0 + "self_attn.q_proj.weight", (6, 8), 0, 2, Layout(3, 3))
    with pytest.raises(ValueError, match="neither divides"):
        shard_box(L0 + "self_attn.k_proj.weight", (6, 8), 0, 2, Layout(6, 3))
    with pytest.raises(ValueError, match="do not split"):
        shard_box(L0 + "mlp.gate_proj.weight", (7, 8), 0, 2, MQA)
    with pytest.raises(ValueError, match="head counts"):
        shard_box(L0 + "mlp.gate_proj.weight", (6, 8), 0, 2, None)
    assert Layout.of_config({"num_attention_heads": 9, "num_key_value_heads": 3}) == Layout(9, 3)
    assert Layout.of_config({"num_attention_heads": 4}) == Layout(4, 4)
    assert Layout.of_config({"hidden_size": 4}) is None


def test_local_positions_by_hand():
    pos = torch.tensor([0, 3, 8, 14, 23])
    val = torch.tensor([10, 11, 12, 13, 14], dtype=torch.int8)
    # [4, 6], columns 2..3: (0,3) -> 1, (1,2) -> 2, (2,2) -> 4; (0,0) and (3,5) are not ours
    got_p, got_v = local_positions(pos, val, (4, 6), Box((0, 4), (2, 2)))
    assert got_p.tolist() == [1, 2, 4] and got_v.tolist() == [11, 12, 13]
    # rows 1..2: positions 6..17 -> 8-6, 14-6
    got_p, got_v = local_positions(pos, val, (4, 6), Box((1, 2)))
    assert got_p.tolist() == [2, 8] and got_v.tolist() == [12, 13]
    got_p, _ = local_positions(pos, val, (4, 6), Box((0, 0)))
    assert got_p.numel() == 0


@pytest.mark.parametrize("name", sorted(TP2))
def test_a_delta_cut_to_each_rank_gives_that_rank_the_new_box(name):
    """The rank's box of v0 + its cut of the delta = the rank's box of v1, bit for bit."""
    shape, _ = TP2[name]
    g = torch.Generator().manual_seed(len(name))
    v0 = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    v1 = torch.where(torch.rand(shape, generator=g) < 0.3, -v0 - 1, v0)
    pos = changed_positions(v0, v1)
    assert pos.numel() > 0
    for r in range(2):
        box = shard_box(name, shape, r, 2, MQA)
        held = take(v0, box).clone()
        p, v = local_positions(pos, v1.reshape(-1)[pos], shape, box)
        held.reshape(-1)[p] = v
        assert torch.equal(held, take(v1, box)), (name, r)
        assert tuple(held.shape) == slice_shape(shape, box)


def test_rank_digests_are_digests_of_the_boxes():
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8).to(torch.bfloat16)
    o = L0 + "self_attn.o_proj.weight"
    assert rank_digests(o, t, 2, MQA) == [tensor_digest(t[:, :4].contiguous()),
                                          tensor_digest(t[:, 4:].contiguous())]
    k = L0 + "self_attn.k_proj.weight"
    assert rank_digests(k, t[:2], 2, MQA) == [tensor_digest(t[:2])] * 2
    assert rank_digests(o, t, 1, None) == [tensor_digest(t)]


def test_cpu_path_padding_by_hand():
    """SGLang's CPU path pads instead of replicating (configs/update_config.py)."""
    assert cpu_padding(Layout(4, 2), 2, 896, None) is None  # 896 = 14 * (2 * 32)
    assert "heads" in cpu_padding(Layout(4, 1), 2, 896, None)  # one kv head over 2 ranks
    assert "heads" in cpu_padding(Layout(9, 3), 2, 1536, None)  # SmolLM2's 9 / 3 at TP 2
    assert "SwiGLU size 896" in cpu_padding(Layout(4, 4), 2, 896, 128)  # 896 % 256
    assert cpu_padding(Layout(4, 4), 2, 1024, 128) is None
    assert "1000" in cpu_padding(Layout(4, 4), 2, 1000, None)
