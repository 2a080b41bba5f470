"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral) <-> megatron-core's MoE layer (local spec,
SequentialMLP experts), per TP shard, and the small family table that tells the two apart.

The attention half of a MoE decoder layer is its dense family's (Qwen3's q/k norms for Qwen3-MoE,
Llama's plain GQA for Mixtral) and maps as qurl/models/convert.py maps it; this module maps the
other half, the sparse MLP block, and says which megatron-core 0.16 settings compute the same
function. It imports no megatron (only `qurl/learner/` does); convert.py calls it for every layer of
a `Qwen3MoeForCausalLM` or `MixtralForCausalLM`.

**What both families compute** (transformers 5 `Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`),
per token x [H] after the post-attention RMSNorm, with E experts, top-k, expert width I:

    logits = W_r x                          router `mlp.gate.weight` [E, H]
    p      = softmax(logits) over all E     in fp32
    S, w   = top-k of p (indices, values);  w /= sum(w)  when renormalised
    y      = sum_{e in S} w_e * down_e(silu(gate_e x) * up_e x)

They differ only in where the numbers live (`FAMILIES`): Qwen3-MoE reads I from
`moe_intermediate_size` and renormalises when `norm_topk_prob`; Mixtral reads I from
`intermediate_size` and always renormalises (Mixtral-8x7B's routing, and Qwen3-30B-A3B's). Mixtral
also has a training-time `router_jitter_noise` (multiplies x by uniform noise in transformers'
train mode) and a `sliding_window` on its attention: qurl's learner has neither, so both must be
off (0 / null).

**The megatron setting that matches** (`MoELayer` with `TopKRouter`, read from 0.16.1's
`transformer/moe/router.py` and `moe_utils.topk_routing_with_score_function`):
- `moe_router_score_function="softmax"` with `moe_router_pre_softmax=False` takes the top-k of the
  *logits* and softmaxes over those k: exp(l_i) / sum_{j in S} exp(l_j), which is the top-k of the
  full softmax renormalised. The top-k set is the same because softmax is monotone.
- `moe_router_pre_softmax=True` softmaxes over all E first and keeps the top-k unrenormalised
  (Qwen3-MoE's `norm_topk_prob=False`).
- top-1 renormalised (every weight 1) has no megatron twin (megatron refuses top-1 without
  pre-softmax: the softmax of one logit has zero gradient) and is refused here.
- `moe_router_dtype="fp32"`: the router's logits are computed in fp32 from whatever dtype the model
  runs in (transformers computes them in the model dtype and softmaxes in fp32; in fp32 the two are
  identical, in bf16 they differ by the logits' rounding).
- no load-balancing loss (`moe_router_load_balancing_type="none"`, `moe_aux_loss_coeff=0`: RL
  fine-tuning trains the policy, not the balance), no z-loss, no input jitter, no capacity factor
  (no token is dropped; transformers drops none), no shared experts, no expert bias.
- `moe_token_dispatcher_type="allgather"`: plain torch collectives (gloo on CPU). At TP > 1 without
  sequence parallelism every TP rank holds the same tokens; the dispatcher all-gathers them over
  TP (TP copies), each rank runs its I/tp slice of every expert on all of them, and the
  reduce-scatter sums the slices and hands each rank its own copy back: the right values, TP times
  the expert work. megatron refuses this layout in *training* mode (its MoELayer asks for sequence
  parallelism when TP > 1); evaluation (logits, log-probs) runs.

**Names and shapes.** Inside qurl every MoE state dict uses one set of HF names, Qwen3-MoE's
checkpoint names (the left column); `per_expert` brings any family's checkpoint (or transformers
5's fused in-memory form) to them, `to_disk` writes them back under the family's own names. Layer
N; shard k of `tp` along the stated dim; I/tp rows per shard:

    qurl's HF names                                Megatron (decoder.layers.N.…)
    mlp.gate.weight              [E, H]        ->  mlp.router.weight                            replicated
    mlp.experts.e.gate_proj.weight [I, H]  }   ->  mlp.experts.local_experts.e.linear_fc1.weight  dim 0
    mlp.experts.e.up_proj.weight   [I, H]  }       [gate rows of shard k ; up rows of shard k]
    mlp.experts.e.down_proj.weight [H, I]      ->  mlp.experts.local_experts.e.linear_fc2.weight  dim 1
    post_attention_layernorm.weight            ->  pre_mlp_layernorm.weight (as for dense layers)

    on disk: Qwen3-MoE as above; Mixtral `block_sparse_moe.gate.weight` and
    `block_sparse_moe.experts.e.{w1,w3,w2}.weight` for gate, up, down (what transformers 5's
    `save_pretrained` writes, its conversion_mapping.py "mixtral" entry, and the names SGLang's
    mixtral.py loads). A suffix after the projection (`weight_scale`, 8-bit exports) is kept.

transformers >= 5 keeps the experts of a layer fused *in memory* for both families
(`Qwen3MoeExperts`, `MixtralExperts`): `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate
rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], the router at `mlp.gate.weight`.
`per_expert` also splits that form, so either state dict loads; `megatron_to_hf` always returns
qurl's per-expert names.

Unsupported, refused in one line by `check_moe`: dense layers among the sparse ones
(`mlp_only_layers`, `decoder_sparse_step` != 1), shared experts, top-1 renormalised, top-k > E,
Mixtral's router jitter or sliding window. Other MoE families (Qwen2-MoE's shared expert,
DeepSeek's MLA and grouped sigmoid router, ...) are refused by architecture in convert.py.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MoeFamily:
    """Where one MoE family keeps what its sparse MLP needs (module docstring)."""

    arch: str  # config.json `architectures`
    model_type: str  # config.json `model_type`
    width_field: str  # the config field holding one expert's SwiGLU width I
    norm_field: str | None  # field saying whether the top-k weights are renormalised; None: always
    block: str  # the sparse block's module name in the checkpoint ("mlp", "block_sparse_moe")
    proj: tuple[str, str, str]  # the checkpoint's names of each expert's gate, up, down projection
    qk_norm: bool  # its attention RMS-normalises q and k per head (Qwen3)
    off_fields: tuple[tuple[str, str], ...] = ()  # (field, what it does) that must be unset or 0


_QWEN_PROJ = ("gate_proj", "up_proj", "down_proj")  # qurl's own names (module docstring)
FAMILIES: tuple[MoeFamily, ...] = (
    MoeFamily("Qwen3MoeForCausalLM", "qwen3_moe", "moe_intermediate_size", "norm_topk_prob", "mlp",
              _QWEN_PROJ, qk_norm=True),
    MoeFamily("MixtralForCausalLM", "mixtral", "intermediate_size", None, "block_sparse_moe",
              ("w1", "w3", "w2"), qk_norm=False,
              off_fields=(("router_jitter_noise", "training-time noise on the router's input"),
                          ("sliding_window", "sliding-window attention"))),
)
ARCHS = tuple(f.arch for f in FAMILIES)
MODEL_TYPES = tuple(f.model_type for f in FAMILIES)
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_DISK = re.compile(r"^(model\.layers\.\d+\.)([a-z_]+)\.(gate\.weight|experts\.(\d+)\.([a-z0-9_]+)\.(.+))$")
_EXPERT_TAIL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_EXPERT_NAME = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_SHARED_FIELDS = ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                  "n_shared_experts", "num_shared_experts")

Take = Callable[[str, tuple[int, ...]], torch.Tensor]


def _field(cfg: Any, name: str, default: Any = None) -> Any:
    """`name` of a config object, a SimpleNamespace of config.json's fields, or the dict itself."""
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


def family(hf_config: Any) -> MoeFamily | None:
    """The MoE family of a config (object, namespace or config.json dict) by its `architectures`,
    else its `model_type`; None for anything else (a dense model, or a MoE family qurl lacks)."""
    archs = list(_field(hf_config, "architectures") or [])
    for f in FAMILIES:
        if f.arch in archs:
            return f
    if archs:
        return None
    return next((f for f in FAMILIES if f.model_type == _field(hf_config, "model_type")), None)


def num_experts(hf_config: Any) -> int:
    """E: `num_experts` (Qwen3-MoE's config.json) or `num_local_experts` (what transformers 5
    writes, and Mixtral's name); 0 for a dense model."""
    return int(_field(hf_config, "num_experts") or _field(hf_config, "num_local_experts") or 0)


def moe_dims(hf_config: Any) -> dict[str, Any]:
    """E (experts), k (experts per token), I (one expert's SwiGLU width), norm (top-k weights
    renormalised) of a MoE family's config."""
    fam = family(hf_config)
    if fam is None:
        raise ValueError(f"config.architectures={_field(hf_config, 'architectures')}: not a "
                         f"mixture-of-experts family qurl takes ({', '.join(ARCHS)})")
    norm = True if fam.norm_field is None else bool(_field(hf_config, fam.norm_field, False))
    return {"E": num_experts(hf_config), "k": int(_field(hf_config, "num_experts_per_tok")),
            "I": int(_field(hf_config, fam.width_field)), "norm": norm}


def route_shape(fields: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """(L MoE layers, k experts per token, E experts) of a MoE's config fields (config.json as a
    dict): the shape of the routes its engine returns per position (qurl/types.py
    GenResult.routed_experts) and their id bound; None for a dense model."""
    E = num_experts(fields)
    if not E or family(fields) is None:
        return None
    return int(fields["num_hidden_layers"]), int(fields["num_experts_per_tok"]), E


def check_moe(hf_config: Any) -> None:
    """ValueError (one line, naming the field) for a MoE config the mapping cannot take."""
    d, fam = moe_dims(hf_config), family(hf_config)
    for field in _SHARED_FIELDS:
        if _field(hf_config, field):
            raise ValueError(f"config.{field}={_field(hf_config, field)}: shared experts are "
                             f"unsupported (routed experts only)")
    if _field(hf_config, "mlp_only_layers"):
        raise ValueError(f"config.mlp_only_layers={list(_field(hf_config, 'mlp_only_layers'))}: "
                         f"dense MLP layers among the MoE layers are unsupported")
    if int(_field(hf_config, "decoder_sparse_step", 1) or 1) != 1:
        raise ValueError(f"config.decoder_sparse_step={_field(hf_config, 'decoder_sparse_step')}: "
                         f"only every layer sparse (1) is supported")
    for field, what in fam.off_fields:
        if _field(hf_config, field):
            raise ValueError(f"config.{field}={_field(hf_config, field)}: {what} is unsupported "
                             f"(qurl's learner has none); it must be null or 0")
    if not 1 <= d["k"] <= d["E"]:
        raise ValueError(f"config.num_experts_per_tok={d['k']}: must be in [1, num_experts={d['E']}]")
    if d["k"] == 1 and d["norm"]:
        why = "norm_topk_prob=True" if fam.norm_field else f"{fam.arch}'s renormalised top-k"
        raise ValueError(f"config.num_experts_per_tok=1 with {why}: megatron-core has no such "
                         "router (every weight 1); unsupported")


def megatron_moe_config(hf_config: Any) -> dict[str, Any]:
    """TransformerConfig kwargs of the MoE layers (see the module docstring for why each)."""
    check_moe(hf_config)
    d = moe_dims(hf_config)
    return {
        "num_moe_experts": d["E"], "moe_ffn_hidden_size": d["I"], "moe_router_topk": d["k"],
        "moe_router_score_function": "softmax", "moe_router_pre_softmax": not d["norm"],
        "moe_router_dtype": "fp32", "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None, "moe_input_jitter_eps": None,
        "moe_expert_capacity_factor": None, "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False, "moe_shared_expert_intermediate_size": None,
        "moe_router_enable_expert_bias": False, "moe_router_fusion": False,
        "moe_permute_fusion": False,
    }


def per_expert(hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`hf_state` under qurl's per-expert names (`mlp.gate.weight`,
    `mlp.experts.e.{gate,up,down}_proj.<suffix>`): transformers 5's fused in-memory experts
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) split (views), and
    another family's checkpoint names (Mixtral's `block_sparse_moe.…w1/w3/w2`) renamed; other
    entries pass through."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_state.items():
        m = _FUSED.match(name)
        if m is None:
            out[_from_disk_name(name)] = t
        elif m.group(2) == "gate_up_proj":
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{m.group(1)}{e}.gate_proj.weight"] = gate
                out[f"{m.group(1)}{e}.up_proj.weight"] = up
        else:
            for e, w in enumerate(t):
                out[f"{m.group(1)}{e}.down_proj.weight"] = w
    return out


def _from_disk_name(name: str) -> str:
    """A family's checkpoint name of a router or expert tensor under qurl's name; others as given."""
    m = _DISK.match(name)
    if m is None:
        return name
    for fam in FAMILIES:
        if m.group(2) != fam.block:
            continue
        if m.group(4) is None:
            return f"{m.group(1)}mlp.gate.weight"
        if m.group(5) in fam.proj:
            return (f"{m.group(1)}mlp.experts.{m.group(4)}."
                    f"{_QWEN_PROJ[fam.proj.index(m.group(5))]}.{m.group(6)}")
    return name


def to_disk(hf_state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """`hf_state` (qurl's per-expert names) under the checkpoint names of `hf_config`'s family
    (Mixtral: `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.e.{w1,w3,w2}.<suffix>`);
    as given for Qwen3-MoE and dense models. The inverse of `per_expert` on per-expert names."""
    fam = family(hf_config)
    if fam is None or (fam.block, fam.proj) == ("mlp", _QWEN_PROJ):
        return dict(hf_state)
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_state.items():
        m = _DISK.match(name)
        if m is None or m.group(2) != "mlp" or (m.group(4) is not None and m.group(5) not in _QWEN_PROJ):
            out[name] = t
        elif m.group(4) is None:
            out[f"{m.group(1)}{fam.block}.gate.weight"] = t
        else:
            out[f"{m.group(1)}{fam.block}.experts.{m.group(4)}."
                f"{fam.proj[_QWEN_PROJ.index(m.group(5))]}.{m.group(6)}"] = t
    return out


def fused(hf_state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """The inverse of `per_expert`: per-expert names stacked into transformers 5's fused
    `mlp.experts.gate_up_proj` / `down_proj` (for `model.load_state_dict`)."""
    E = num_experts(hf_config)
    out = {k: v for k, v in hf_state.items() if ".mlp.experts." not in k}
    for i in range(int(hf_config.num_hidden_layers)):
        p = f"model.layers.{i}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat([hf_state[f"{p}{e}.gate_proj.weight"],
                                                          hf_state[f"{p}{e}.up_proj.weight"]])
                                               for e in range(E)])
        out[p + "down_proj"] = torch.stack([hf_state[f"{p}{e}.down_proj.weight"] for e in range(E)])
    return out


def mlp_to_megatron(take: Take, hf_prefix: str, meg_prefix: str, hf_config: Any, *, H: int,
                    tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """One layer's sparse MLP as TP shard `tp_rank`'s Megatron tensors. `take(name, shape)` returns
    the HF tensor (checking its shape, marking it used); prefixes end with the layer's dot."""
    d = moe_dims(hf_config)
    E, I = d["E"], d["I"]

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp_size, dim=dim)[tp_rank].contiguous()

    out = {meg_prefix + "mlp.router.weight": take(hf_prefix + "mlp.gate.weight", (E, H)).clone()}
    for e in range(E):
        src, dst = f"{hf_prefix}mlp.experts.{e}.", f"{meg_prefix}mlp.experts.local_experts.{e}."
        gate, up = take(src + "gate_proj.weight", (I, H)), take(src + "up_proj.weight", (I, H))
        out[dst + "linear_fc1.weight"] = torch.cat([shard(gate, 0), shard(up, 0)])  # [2I/tp, H]
        out[dst + "linear_fc2.weight"] = shard(take(src + "down_proj.weight", (H, I)), 1)  # [H, I/tp]
    return out


def partition_dim(tail: str) -> tuple[bool, int | None]:
    """(is a MoE parameter, its TP split dim or None = replicated) for a layer-relative name."""
    if tail == "mlp.router.weight":
        return True, None
    m = _EXPERT_TAIL.match(tail)
    if m is None:
        return False, None
    return True, 0 if m.group(2) == "linear_fc1" else 1


def param_to_hf(tail: str, hf_prefix: str, shards: Sequence[torch.Tensor]
                ) -> list[tuple[str, torch.Tensor]] | None:
    """HF (name, full tensor) pairs of one layer's MoE parameter from its TP shards in rank order,
    or None when `tail` is not a MoE parameter. The router is returned as given (no copy)."""
    if tail == "mlp.router.weight":
        return [(hf_prefix + "mlp.gate.weight", shards[0])]
    m = _EXPERT_TAIL.match(tail)
    if m is None:
        return None
    p = f"{hf_prefix}mlp.experts.{m.group(1)}."
    if m.group(2) == "linear_fc2":
        return [(p + "down_proj.weight", torch.cat(list(shards), dim=1))]
    halves = [s.chunk(2, dim=0) for s in shards]  # each shard: [its gate rows; its up rows]
    return [(p + "gate_proj.weight", torch.cat([g for g, _ in halves])),
            (p + "up_proj.weight", torch.cat([u for _, u in halves]))]


# ------------------------------------------------------------------ expert parallelism


def expert_index(name: str) -> tuple[str, int, str] | None:
    """(layer prefix `decoder.layers.N.mlp.experts.local_experts.`, expert index, the rest
    `.linear_fc1.weight`) of a Megatron expert parameter name, or None for any other name."""
    m = _EXPERT_NAME.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def ep_shard(shard: Mapping[str, torch.Tensor], ep_rank: int, ep_size: int,
             num_experts: int) -> dict[str, torch.Tensor]:
    """Expert-parallel rank `ep_rank`'s part of a Megatron shard holding all `num_experts` experts
    (convert.hf_to_megatron's): the experts [ep_rank·E/ep, (ep_rank+1)·E/ep), renumbered from 0 as
    megatron-core's `SequentialMLP` names its local experts (`MoELayer.local_expert_indices`:
    global index = ep_rank·E/ep + local index); every other tensor as given."""
    if ep_size < 1 or num_experts % ep_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert-parallel rank {ep_rank} of {ep_size}: must divide the "
                         f"{num_experts} experts")
    per = num_experts // ep_size
    out: dict[str, torch.Tensor] = {}
    for name, t in shard.items():
        parts = expert_index(name)
        if parts is None:
            out[name] = t
        elif ep_rank * per <= parts[1] < (ep_rank + 1) * per:
            out[f"{parts[0]}{parts[1] - ep_rank * per}{parts[2]}"] = t
    return out
