"""HF Qwen2/Qwen3/Llama/Qwen3-MoE/Mixtral weights <-> megatron-core GPTModel (local layer spec) weights, per TP shard.

The learner trains a megatron-core `GPTModel` built with `get_gpt_layer_local_spec` (RMSNorm, SwiGLU,
RoPE, GQA); the rollout engines and the checkpoints on disk use Hugging Face names. This module maps
one to the other. It imports no megatron (only `qurl/learner/` does); it returns plain kwargs.

Megatron layout, for `nh` query heads, `ng` KV heads (query groups), `r = nh // ng`, head dim `hd`,
hidden `H`, TP size `tp` (ng % tp == 0) — shard `k` of `tp` along the stated dim:

    HF                                         Megatron (decoder.layers.N.…)
    self_attn.{q,k,v}_proj.weight/bias     ->  self_attention.linear_qkv.weight/bias   dim 0
        fused per query group g: [q heads g*r..g*r+r-1 (r*hd rows), k head g (hd), v head g (hd)],
        groups in order; shard k holds groups k*ng/tp .. (k+1)*ng/tp-1 (a contiguous row block)
    self_attn.o_proj.weight                ->  self_attention.linear_proj.weight      dim 1
    mlp.{gate,up}_proj.weight              ->  mlp.linear_fc1.weight                  dim 0
        shard k is [gate rows of shard k ; up rows of shard k], so concatenating shards is NOT
        [gate; up]: each shard is split in halves before the halves are concatenated
    mlp.down_proj.weight                   ->  mlp.linear_fc2.weight                  dim 1
    input_layernorm / post_attention_layernorm -> input_layernorm / pre_mlp_layernorm (replicated)
    model.embed_tokens.weight, lm_head.weight -> embedding.word_embeddings.weight, output_layer.weight
        dim 0, vocab zero-padded to `padded_vocab_size` (the learner masks the padded logits)
    model.norm.weight                      ->  decoder.final_layernorm.weight        (replicated)
    self_attn.{q,k}_norm.weight (Qwen3)    ->  self_attention.{q,k}_layernorm.weight (replicated)
        Qwen3 RMS-normalises each head of q and k over head_dim (one gain vector shared by every
        head) before RoPE; megatron's `qk_layernorm=True` spec does the same. Each TP rank sees
        only its own heads, so these gains' gradients are partial sums: the learner adds them over
        the TP group (`tp_partial_grad`) before the optimizer step, as megatron's own
        finalize_model_grads does.

Transformer Engine layer spec (`get_gpt_layer_with_transformer_engine_spec`): the RMSNorm before
attention and before the MLP is fused into the linear that follows it, so the two norm gains are
named `self_attention.linear_qkv.layer_norm_weight` and `mlp.linear_fc1.layer_norm_weight` (and TE
modules add `_extra_state` entries). `to_te_names` / `from_te_name` translate; every other name,
shape and shard layout is the same as the local spec's.

Qwen3-MoE (`Qwen3MoeForCausalLM`) and Mixtral (`MixtralForCausalLM`): Qwen3's attention, or
Llama's (no q/k norms), as above; the sparse MLP (router and experts) maps as qurl/models/moe.py
says, which also holds the megatron MoE settings that compute what transformers computes and the
family table telling the two apart. `dims()['I']` is then one expert's width
(`moe_intermediate_size`; Mixtral's `intermediate_size`).

Tied embeddings (`tie_word_embeddings`): Megatron has no `output_layer.weight`; HF has no (or an
ignored) `lm_head.weight`, and `megatron_to_hf` emits none.

Invariants: `megatron_to_hf([hf_to_megatron(sd, cfg, tp_rank=k, tp_size=tp) for k in range(tp)], cfg)`
equals `sd` bit for bit (minus a tied `lm_head.weight`) for every tp dividing the head counts; every
HF weight is consumed (unknown names are errors) and every Megatron parameter is produced.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from qurl.models import moe

SUPPORTED_ARCHS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", *moe.ARCHS)
# HF buffers that may appear in old state dicts and carry no weights.
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


# ------------------------------------------------------------------ architecture


def _arch(hf_config: Any) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", "")
    if not archs:
        archs = {"qwen2": ["Qwen2ForCausalLM"], "qwen3": ["Qwen3ForCausalLM"],
                 "llama": ["LlamaForCausalLM"],
                 **{f.model_type: [f.arch] for f in moe.FAMILIES}}.get(model_type, [])
    for a in archs:
        if a in SUPPORTED_ARCHS:
            return a
    raise ValueError(f"config.architectures={archs or None} (model_type={model_type!r}): "
                     f"unsupported, expected one of {SUPPORTED_ARCHS}")


def _rope_theta(hf_config: Any) -> float:
    """RoPE base: `rope_theta` (transformers 4) or `rope_parameters['rope_theta']` (transformers 5)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise ValueError(f"config.rope_parameters.rope_type={rope_type!r}: only plain RoPE "
                         "('default') is supported by the Megatron conversion")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("config: no rope_theta (nor rope_parameters['rope_theta'])")
    return float(theta)


def is_moe(hf_config: Any) -> bool:
    """A Qwen3-MoE or Mixtral (every decoder layer's MLP is routed experts; qurl/models/moe.py)."""
    return _arch(hf_config) in moe.ARCHS


def dims(hf_config: Any) -> dict[str, int]:
    """Head counts and sizes: nh, ng (KV heads), hd (head dim), H (hidden), I (ffn; one expert's
    for a MoE), V (vocab), L."""
    nh = int(hf_config.num_attention_heads)
    ng = int(getattr(hf_config, "num_key_value_heads", None) or nh)
    H = int(hf_config.hidden_size)
    hd = int(getattr(hf_config, "head_dim", None) or H // nh)
    if nh % ng:
        raise ValueError(f"config: num_attention_heads={nh} not a multiple of num_key_value_heads={ng}")
    ffn = moe.moe_dims(hf_config)["I"] if is_moe(hf_config) else hf_config.intermediate_size
    return {"nh": nh, "ng": ng, "hd": hd, "H": H, "I": int(ffn),
            "V": int(hf_config.vocab_size), "L": int(hf_config.num_hidden_layers)}


def qkv_bias(hf_config: Any) -> bool:
    """Qwen2 always has q/k/v biases; Llama and Qwen3 have none (attention_bias=True would add an
    o_proj bias too)."""
    arch = _arch(hf_config)
    if arch == "Qwen2ForCausalLM":
        return True
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError(f"config.attention_bias/mlp_bias=True: {arch} with linear biases is "
                         "unsupported")
    return False


def qk_norm(hf_config: Any) -> bool:
    """Qwen3 (and Qwen3-MoE) RMS-normalises q and k per head (q_norm, k_norm) before RoPE; Llama
    and Mixtral do not."""
    fam = moe.family(hf_config)
    return _arch(hf_config) == "Qwen3ForCausalLM" or (fam is not None and fam.qk_norm)


def check_supported(hf_config: Any) -> None:
    """ValueError naming what the conversion cannot take: architecture, activation, sliding
    windows, RoPE scaling, linear biases, MoE options (every check the learner would make later,
    at once)."""
    arch = _arch(hf_config)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"config.hidden_act={hf_config.hidden_act!r}: only silu (SwiGLU) is supported")
    windowed = [t for t in (getattr(hf_config, "layer_types", None) or []) if t != "full_attention"]
    if getattr(hf_config, "use_sliding_window", False) or windowed:
        raise ValueError("config: sliding-window attention layers are unsupported")
    if arch in moe.ARCHS:
        moe.check_moe(hf_config)
    elif moe.num_experts(hf_config):
        raise ValueError(f"config.num_experts={moe.num_experts(hf_config)} on {arch}: "
                         f"mixture-of-experts layers are supported for {' and '.join(moe.ARCHS)} only")
    _rope_theta(hf_config)
    qkv_bias(hf_config)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's rule: round the vocab up to a multiple of divisible_by * tp."""
    m = divisible_by * tp
    return -(-vocab_size // m) * m


def _check_tp(hf_config: Any, tp: int) -> dict[str, int]:
    d = dims(hf_config)
    if tp < 1 or d["nh"] % tp or d["ng"] % tp or d["I"] % tp:
        ffn = moe.family(hf_config).width_field if is_moe(hf_config) else "intermediate_size"
        raise ValueError(f"learner.tp={tp}: must divide num_attention_heads={d['nh']}, "
                         f"num_key_value_heads={d['ng']} and {ffn}={d['I']}")
    return d


def megatron_config_from_hf(hf_config: Any, *, tp: int, dtype: torch.dtype) -> dict[str, Any]:
    """TransformerConfig kwargs describing the HF architecture (runtime flags are the learner's)."""
    check_supported(hf_config)
    d = _check_tp(hf_config, tp)
    return (moe.megatron_moe_config(hf_config) if is_moe(hf_config) else {}) | {
        "num_layers": d["L"], "hidden_size": d["H"], "ffn_hidden_size": d["I"],
        "num_attention_heads": d["nh"], "num_query_groups": d["ng"], "kv_channels": d["hd"],
        "normalization": "RMSNorm", "layernorm_epsilon": float(hf_config.rms_norm_eps),
        "gated_linear_unit": True, "activation_func": F.silu,
        "add_bias_linear": False, "add_qkv_bias": qkv_bias(hf_config), "qk_layernorm": qk_norm(hf_config),
        "tensor_model_parallel_size": tp, "params_dtype": dtype,
        "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16,
        "hidden_dropout": 0.0, "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0)),
    }


def gpt_model_kwargs_from_hf(hf_config: Any, *, tp: int, divisible_by: int = 128) -> dict[str, Any]:
    """GPTModel kwargs (besides config and layer spec): padded vocab, RoPE base, tied embeddings."""
    return {
        "vocab_size": padded_vocab_size(int(hf_config.vocab_size), tp, divisible_by),
        "max_sequence_length": int(getattr(hf_config, "max_position_embeddings", 4096)),
        "position_embedding_type": "rope", "rotary_percent": 1.0,
        "rotary_base": _rope_theta(hf_config),
        "share_embeddings_and_output_weights": bool(getattr(hf_config, "tie_word_embeddings", False)),
    }


# ------------------------------------------------------------------ HF -> Megatron


def _take(hf: Mapping[str, torch.Tensor], used: set[str], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in hf:
        raise ValueError(f"HF state dict: missing {name}")
    t = hf[name]
    if tuple(t.shape) != shape:
        raise ValueError(f"HF state dict: {name} has shape {tuple(t.shape)}, expected {shape}")
    used.add(name)
    return t


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], hf_config: Any, *, tp_rank: int,
                   tp_size: int, divisible_by: int = 128) -> dict[str, torch.Tensor]:
    """The Megatron parameters of TP shard `tp_rank` (fresh contiguous tensors, HF dtype kept). A
    MoE's experts may come under its family's checkpoint names, qurl's per-expert names or fused
    (transformers 5 in memory); qurl/models/moe.py `per_expert`."""
    d = _check_tp(hf_config, tp_size)
    sparse = is_moe(hf_config)
    if sparse:
        hf_state = moe.per_expert(hf_state)
    nh, ng, hd, H, I, V = d["nh"], d["ng"], d["hd"], d["H"], d["I"], d["V"]
    r, tied, bias = nh // ng, bool(getattr(hf_config, "tie_word_embeddings", False)), qkv_bias(hf_config)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} not in [0, {tp_size})")
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp_size, dim=dim)[tp_rank].contiguous()

    def vocab(name: str) -> torch.Tensor:
        w = _take(hf_state, used, name, (V, H))
        pad = padded_vocab_size(V, tp_size, divisible_by) - V
        return shard(torch.cat([w, w.new_zeros(pad, H)]) if pad else w, 0)

    out["embedding.word_embeddings.weight"] = vocab("model.embed_tokens.weight")
    for i in range(d["L"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = _take(hf_state, used, p + "input_layernorm.weight", (H,)).clone()
        out[m + "pre_mlp_layernorm.weight"] = _take(
            hf_state, used, p + "post_attention_layernorm.weight", (H,)).clone()
        for kind in ("weight", "bias") if bias else ("weight",):
            tail = (H,) if kind == "weight" else ()
            q = _take(hf_state, used, f"{p}self_attn.q_proj.{kind}", (nh * hd, *tail))
            k = _take(hf_state, used, f"{p}self_attn.k_proj.{kind}", (ng * hd, *tail))
            v = _take(hf_state, used, f"{p}self_attn.v_proj.{kind}", (ng * hd, *tail))
            fused = torch.cat([q.reshape(ng, r * hd, *tail), k.reshape(ng, hd, *tail),
                               v.reshape(ng, hd, *tail)], dim=1)  # [ng, (r+2)*hd, (H)]
            out[f"{m}self_attention.linear_qkv.{kind}"] = shard(fused.reshape(ng * (r + 2) * hd, *tail), 0)
        if qk_norm(hf_config):
            for x in ("q", "k"):
                out[f"{m}self_attention.{x}_layernorm.weight"] = _take(
                    hf_state, used, f"{p}self_attn.{x}_norm.weight", (hd,)).clone()
        out[m + "self_attention.linear_proj.weight"] = shard(
            _take(hf_state, used, p + "self_attn.o_proj.weight", (H, nh * hd)), 1)
        if sparse:
            out.update(moe.mlp_to_megatron(lambda n, s: _take(hf_state, used, n, s), p, m, hf_config,
                                           H=H, tp_rank=tp_rank, tp_size=tp_size))
        else:
            gate = _take(hf_state, used, p + "mlp.gate_proj.weight", (I, H))
            up = _take(hf_state, used, p + "mlp.up_proj.weight", (I, H))
            out[m + "mlp.linear_fc1.weight"] = torch.cat([shard(gate, 0), shard(up, 0)])
            out[m + "mlp.linear_fc2.weight"] = shard(
                _take(hf_state, used, p + "mlp.down_proj.weight", (H, I)), 1)
    out["decoder.final_layernorm.weight"] = _take(hf_state, used, "model.norm.weight", (H,)).clone()
    if tied:
        used.add("lm_head.weight")  # a tied lm_head (if saved at all) is the embedding
    else:
        out["output_layer.weight"] = vocab("lm_head.weight")
    extra = sorted(n for n in hf_state if n not in used and not _IGNORED_HF.match(n))
    if extra:
        raise ValueError(f"HF state dict: unexpected weights {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    return out


# ------------------------------------------------------------------ Transformer Engine names

_TE_TAILS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_FROM_TE = {te: local for local, te in _TE_TAILS.items()}


def _rename_tail(name: str, table: Mapping[str, str]) -> str:
    m = _LAYER.match(name)
    if m is None or m.group(2) not in table:
        return name
    return f"decoder.layers.{m.group(1)}.{table[m.group(2)]}"


def to_te_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A local-spec Megatron state dict under Transformer Engine spec names (fused norm gains)."""
    return {_rename_tail(k, _TE_TAILS): v for k, v in state.items()}


def from_te_name(name: str) -> str:
    """The local-spec name of a Transformer Engine spec parameter (identity for local names)."""
    return _rename_tail(name, _FROM_TE)


# ------------------------------------------------------------------ Megatron -> HF

_PARTITION_DIMS = {
    "self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1, "mlp.linear_fc1.weight": 0, "mlp.linear_fc2.weight": 1,
    "input_layernorm.weight": None, "pre_mlp_layernorm.weight": None,
    "self_attention.q_layernorm.weight": None, "self_attention.k_layernorm.weight": None,
}


def partition_dim(name: str) -> int | None:
    """The dim along which Megatron parameter `name` is split across TP ranks; None = replicated.
    (megatron only tags parameters with `partition_dim` when it initializes them itself.)"""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if name == "decoder.final_layernorm.weight":
        return None
    m = _LAYER.match(name)
    if m is not None:
        known, dim = moe.partition_dim(m.group(2))
        if known:
            return dim
    if m is None or m.group(2) not in _PARTITION_DIMS:
        raise ValueError(f"Megatron parameter {name!r}: no HF counterpart")
    return _PARTITION_DIMS[m.group(2)]


def tp_partial_grad(name: str) -> bool:
    """A replicated parameter whose gradient each TP rank holds only part of (Qwen3's q/k norm
    gains: each rank normalises only its own heads); summed over the TP group before a step."""
    m = _LAYER.match(name)
    return m is not None and m.group(2) in ("self_attention.q_layernorm.weight",
                                            "self_attention.k_layernorm.weight")



def megatron_param_to_hf(name: str, shards: Sequence[torch.Tensor], hf_config: Any) -> list[tuple[str, torch.Tensor]]:
    """HF (name, full tensor) pairs for one Megatron parameter given its shards from every TP rank
    in rank order (a replicated parameter may pass a single tensor). Replicated tensors are returned
    as given (no copy): do not modify them in place."""
    d = dims(hf_config)
    nh, ng, hd, H, V = d["nh"], d["ng"], d["hd"], d["H"], d["V"]
    r = nh // ng
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        hf_name = "model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"
        return [(hf_name, torch.cat(list(shards))[:V])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"Megatron parameter {name!r}: no HF counterpart")
    p, tail = f"model.layers.{m.group(1)}.", m.group(2)
    sparse = moe.param_to_hf(tail, p, shards)
    if sparse is not None:
        return sparse
    if tail == "input_layernorm.weight":
        return [(p + "input_layernorm.weight", shards[0])]
    if tail == "pre_mlp_layernorm.weight":
        return [(p + "post_attention_layernorm.weight", shards[0])]
    if tail in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        return [(f"{p}self_attn.{tail.split('.')[1][0]}_norm.weight", shards[0])]
    if tail in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = tail.rsplit(".", 1)[1]
        rest = (H,) if kind == "weight" else ()
        fused = torch.cat(list(shards)).reshape(ng, (r + 2) * hd, *rest)
        q, k, v = fused.split([r * hd, hd, hd], dim=1)
        return [(f"{p}self_attn.q_proj.{kind}", q.reshape(nh * hd, *rest)),
                (f"{p}self_attn.k_proj.{kind}", k.reshape(ng * hd, *rest)),
                (f"{p}self_attn.v_proj.{kind}", v.reshape(ng * hd, *rest))]
    if tail == "self_attention.linear_proj.weight":
        return [(p + "self_attn.o_proj.weight", torch.cat(list(shards), dim=1))]
    if tail == "mlp.linear_fc1.weight":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(p + "mlp.gate_proj.weight", torch.cat([g for g, _ in halves])),
                (p + "mlp.up_proj.weight", torch.cat([u for _, u in halves]))]
    if tail == "mlp.linear_fc2.weight":
        return [(p + "mlp.down_proj.weight", torch.cat(list(shards), dim=1))]
    raise ValueError(f"Megatron parameter {name!r}: no HF counterpart")


def megatron_to_hf(shards: Sequence[Mapping[str, Any]], hf_config: Any) -> dict[str, torch.Tensor]:
    """Full HF state dict from the Megatron state dicts of all TP ranks (rank order). Entries that
    are not tensors (`*._extra_state`) are skipped."""
    if not shards:
        raise ValueError("megatron_to_hf: no shards")
    out: dict[str, torch.Tensor] = {}
    for name, value in shards[0].items():
        if name.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        out.update(megatron_param_to_hf(name, [s[name] for s in shards], hf_config))
    return out
