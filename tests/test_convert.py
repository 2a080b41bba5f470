"""HF <-> Megatron conversion: exact round trips, the fused layouts built by hand, errors.

(Megatron logits vs transformers logits, which need megatron-core processes, are in test_learner.py.)
"""
from __future__ import annotations

import pytest
import torch
from tiny_hf import VOCAB, build, hf_state

from qurl.models import convert

KINDS = ("qwen2", "qwen2-untied", "qwen3", "llama")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_exact(kind: str, tp: int) -> None:
    model = build(kind)
    sd = hf_state(model)
    shards = [convert.hf_to_megatron(sd, model.config, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = convert.megatron_to_hf(shards, model.config)
    assert sorted(back) == sorted(sd)
    for name, t in sd.items():
        assert torch.equal(back[name], t), name


def test_qkv_layout_per_query_group() -> None:
    """Shard k of linear_qkv is [q heads of group g, k head g, v head g] for its groups, in order."""
    model = build("qwen2")
    cfg, sd = model.config, hf_state(model)
    nh, ng, hd = 4, 2, 16
    r = nh // ng
    attn = "model.layers.1.self_attn."
    for tp in (1, 2):
        for rank in range(tp):
            meg = convert.hf_to_megatron(sd, cfg, tp_rank=rank, tp_size=tp)
            w = meg["decoder.layers.1.self_attention.linear_qkv.weight"]
            b = meg["decoder.layers.1.self_attention.linear_qkv.bias"]
            groups = range(rank * ng // tp, (rank + 1) * ng // tp)
            rows_w, rows_b = [], []
            for g in groups:
                for h in range(g * r, (g + 1) * r):
                    rows_w.append(sd[attn + "q_proj.weight"][h * hd:(h + 1) * hd])
                    rows_b.append(sd[attn + "q_proj.bias"][h * hd:(h + 1) * hd])
                for proj in ("k_proj", "v_proj"):
                    rows_w.append(sd[attn + proj + ".weight"][g * hd:(g + 1) * hd])
                    rows_b.append(sd[attn + proj + ".bias"][g * hd:(g + 1) * hd])
            assert torch.equal(w, torch.cat(rows_w))
            assert torch.equal(b, torch.cat(rows_b))


def test_fc1_is_gate_then_up_per_shard_and_vocab_padding() -> None:
    model = build("llama")
    cfg, sd = model.config, hf_state(model)
    inter = cfg.intermediate_size
    padded = convert.padded_vocab_size(VOCAB, 2)
    for rank in range(2):
        meg = convert.hf_to_megatron(sd, cfg, tp_rank=rank, tp_size=2)
        fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(fc1, torch.cat([sd["model.layers.0.mlp.gate_proj.weight"][half],
                                           sd["model.layers.0.mlp.up_proj.weight"][half]]))
        for meg_name, hf_name in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                                  ("output_layer.weight", "lm_head.weight")):
            rows = meg[meg_name]
            assert rows.shape == (padded // 2, cfg.hidden_size)
            full = torch.cat([sd[hf_name], torch.zeros(padded - VOCAB, cfg.hidden_size)])
            assert torch.equal(rows, full[rank * padded // 2:(rank + 1) * padded // 2])


def test_padded_vocab_size() -> None:
    assert convert.padded_vocab_size(100, 1) == 128
    assert convert.padded_vocab_size(100, 2) == 256
    assert convert.padded_vocab_size(256, 2) == 256
    assert convert.padded_vocab_size(151936, 4) == 152064
    assert convert.padded_vocab_size(100, 2, divisible_by=1) == 100


def test_config_mapping() -> None:
    q, l = build("qwen2").config, build("llama").config
    kq = convert.megatron_config_from_hf(q, tp=2, dtype=torch.float32)
    kl = convert.megatron_config_from_hf(l, tp=1, dtype=torch.bfloat16)
    assert (kq["num_query_groups"], kq["kv_channels"], kq["add_qkv_bias"]) == (2, 16, True)
    assert (kl["kv_channels"], kl["add_qkv_bias"], kl["bf16"], kl["layernorm_epsilon"]) == (32, False, True, 1e-5)
    gq = convert.gpt_model_kwargs_from_hf(q, tp=2)
    gl = convert.gpt_model_kwargs_from_hf(l, tp=1)
    assert (gq["rotary_base"], gq["share_embeddings_and_output_weights"], gq["vocab_size"]) == (5000.0, True, 256)
    assert (gl["rotary_base"], gl["share_embeddings_and_output_weights"]) == (20000.0, False)
    k3 = convert.megatron_config_from_hf(build("qwen3").config, tp=2, dtype=torch.float32)
    assert (k3["qk_layernorm"], k3["kv_channels"], k3["add_qkv_bias"]) == (True, 32, False)
    assert not kq["qk_layernorm"] and not kl["qk_layernorm"]


def test_qwen3_norm_gains_are_replicated_and_their_gradients_tp_partial() -> None:
    model = build("qwen3")
    cfg, sd = model.config, hf_state(model)
    shards = [convert.hf_to_megatron(sd, cfg, tp_rank=k, tp_size=2) for k in range(2)]
    name = "decoder.layers.1.self_attention.q_layernorm.weight"
    assert torch.equal(shards[0][name], sd["model.layers.1.self_attn.q_norm.weight"])
    assert torch.equal(shards[1][name], shards[0][name])  # whole on every rank
    assert convert.partition_dim(name) is None and convert.tp_partial_grad(name)
    assert not convert.tp_partial_grad("decoder.layers.1.input_layernorm.weight")


def test_errors_name_the_problem() -> None:
    model = build("qwen2")
    cfg, sd = model.config, hf_state(model)
    with pytest.raises(ValueError, match="tp=4"):
        convert.hf_to_megatron(sd, cfg, tp_rank=0, tp_size=4)  # 2 KV heads
    broken = dict(sd)
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        convert.hf_to_megatron(broken, cfg, tp_rank=0, tp_size=1)
    broken = dict(sd, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \(3, 3\)"):
        convert.hf_to_megatron(broken, cfg, tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match="unexpected weights.*mystery"):
        convert.hf_to_megatron(dict(sd, mystery=torch.zeros(1)), cfg, tp_rank=0, tp_size=1)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.model_type = "gpt2"
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        convert.megatron_config_from_hf(cfg, tp=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="no HF counterpart"):
        convert.megatron_param_to_hf("decoder.layers.0.mystery.weight", [torch.zeros(1)], build("llama").config)


def test_transformer_engine_names_fuse_the_norm_gains() -> None:
    model = build("qwen2")
    local = convert.hf_to_megatron(hf_state(model), model.config, tp_rank=0, tp_size=1)
    te = convert.to_te_names(local)
    renamed = {k for k in local if k not in te}
    assert renamed == {f"decoder.layers.{i}.{n}" for i in range(2)
                       for n in ("input_layernorm.weight", "pre_mlp_layernorm.weight")}
    assert torch.equal(te["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"],
                       local["decoder.layers.1.input_layernorm.weight"])
    assert torch.equal(te["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"],
                       local["decoder.layers.0.pre_mlp_layernorm.weight"])
    assert {convert.from_te_name(k) for k in te} == set(local)  # back to the local names
    assert convert.from_te_name("decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"


def test_transformer_engine_choice_on_cpu() -> None:
    from qurl.learner.build import use_transformer_engine

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert use_transformer_engine("auto") is False and use_transformer_engine("off") is False
    with pytest.raises(ValueError, match="deploy.ranks.transformer_engine='on'"):
        use_transformer_engine("on")
