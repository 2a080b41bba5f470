"""Building the learner's megatron-core GPTModel from an HF checkpoint.

`read_hf` reads the checkpoint (state dict + transformers config); `build_gpt` makes one TP rank's
GPTModel from the converted shard (qurl/models/convert.py) with one of megatron's two layer specs:

- the **Transformer Engine** spec (`get_gpt_layer_with_transformer_engine_spec`: TE linears with the
  RMSNorm fused into the linear that follows it, TE attention) — CUDA only;
- the **local** spec (`get_gpt_layer_local_spec`: plain torch modules) — what runs on CPU, and
  on GPUs without TE, and the only one for a Qwen3-MoE (its experts are megatron's
  `SequentialMLP`, one local MLP per expert; qurl/models/moe.py). Its core attention is qurl's
  `SDPAttention` (attention.py: torch SDPA, causal, no [heads, L, L] scores kept) unless `attention="unfused"` asks for megatron's own
  `DotProductAttention` (kept as the reference the SDPA path is tested and benchmarked against).

Activation recompute is megatron-core's own (`recompute`, the learner.recompute field):
- "none": every layer keeps its activations for the backward;
- "selective": the core attention and the MLP of every layer are recomputed in the backward
  (`recompute_granularity="selective"`, `recompute_modules=["core_attn", "mlp"]`): a layer keeps
  its norm outputs, Q/K/V and projections, not the MLP's [L, 3·ffn/TP] intermediates;
- "full": each layer keeps only its input and is run again in the backward
  (`recompute_granularity="full"`, `recompute_method="uniform"`, `recompute_num_layers=1`).
Recompute changes what is stored, never the values: gradients are equal (tests/test_long_seq.py).

`use_transformer_engine(deploy.ranks.transformer_engine)` picks: "auto" = TE when it imports and CUDA
is present, "on" = TE or a clear error, "off" = local. Either way no weight is initialized (every
one is loaded; a missing or unexpected name is an error), no fused CUDA-only kernel is asked for,
and softmax runs in fp32.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from qurl.models import convert, moe

_RUNTIME_FLAGS = {  # no fused CUDA kernels, no init (every weight is loaded), fp32 softmax
    "perform_initialization": False, "bias_activation_fusion": False, "bias_dropout_fusion": False,
    "masked_softmax_fusion": False, "apply_rope_fusion": False, "persist_layer_norm": False,
    "gradient_accumulation_fusion": False, "attention_softmax_in_fp32": True,
    # 0.16's default "full" is rewritten to [] with a deprecation warning; [] means the same
    # (a CUDA graph would capture the whole layer; qurl captures none)
    "cuda_graph_scope": [],
}


def read_hf(model_dir: str | Path) -> tuple[dict[str, torch.Tensor], Any]:
    """(state dict, transformers config) of an HF checkpoint directory; errors name the file."""
    from transformers import AutoConfig

    from qurl.models.hf import read_state_dict

    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"checkpoint {model_dir}: missing config.json")
    return read_state_dict(model_dir), AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def use_transformer_engine(choice: str) -> bool:
    """deploy.ranks.transformer_engine: 'auto' -> TE when it imports and CUDA is present; 'on' -> TE or
    a clear error; 'off' -> megatron's local spec."""
    if choice == "off":
        return False
    if choice not in ("auto", "on"):
        raise ValueError(f"deploy.ranks.transformer_engine={choice!r}: must be auto, on or off")
    try:
        import transformer_engine.pytorch  # noqa: F401
        importable, why = torch.cuda.is_available(), "it needs a CUDA device"
    except ImportError as e:
        importable, why = False, f"transformer_engine does not import ({e})"
    if choice == "on" and not importable:
        raise ValueError(f"deploy.ranks.transformer_engine='on': {why}")
    return importable


ATTENTION = ("sdpa", "unfused")
RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1},
}


def build_gpt(shard: dict[str, torch.Tensor], hf_config: Any, *, tp: int, dtype: torch.dtype,
              device: torch.device, te: bool, attention: str = "sdpa",
              recompute: str = "none", routing_replay: bool = False, ep: int = 1) -> torch.nn.Module:
    """This TP rank's GPTModel holding `shard` (local-spec names, as convert.hf_to_megatron
    makes them; with `ep` > 1 only this expert-parallel rank's experts, numbered from 0:
    expert_parallel.py), parameters in `dtype` on `device`; `attention` (local spec only) and
    `recompute` as in the module docstring; `routing_replay` (a MoE only): every router gets
    megatron's RouterReplay (replay.py)."""
    if attention not in ATTENTION:
        raise ValueError(f"learner.attention={attention!r}: must be one of {', '.join(ATTENTION)}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"learner.recompute={recompute!r}: must be one of {', '.join(RECOMPUTE)}")
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = convert.megatron_config_from_hf(hf_config, tp=tp, dtype=dtype)
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    flags = dict(_RUNTIME_FLAGS, use_cpu_initialization=device.type == "cpu")
    kwargs.update({k: v for k, v in flags.items() if k in known})  # newer mcore may drop some
    kwargs.update(RECOMPUTE[recompute])
    if ep > 1:  # the EP groups themselves come from parallel_state (init_learner_dist)
        kwargs["expert_model_parallel_size"] = ep
    if routing_replay:
        if not convert.is_moe(hf_config):
            raise ValueError("algo.routing_replay='rollout': the model has no experts to replay")
        kwargs["moe_enable_routing_replay"] = True
    config = TransformerConfig(**kwargs)
    experts = moe.num_experts(hf_config) if convert.is_moe(hf_config) else None
    if te and experts:
        raise ValueError("deploy.ranks.transformer_engine: mixture-of-experts models run on "
                         "megatron's local spec only (set it to off or auto)")
    if experts:
        from megatron_patches.moe import apply_moe_patches

        apply_moe_patches()  # megatron's router without Transformer Engine
    if te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=convert.qk_norm(hf_config))
        shard = convert.to_te_names(shard)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=convert.qk_norm(hf_config),
                                                        normalization="RMSNorm",
                                                        num_experts=experts, moe_grouped_gemm=False)
        if attention == "sdpa":
            from qurl.learner.attention import SDPAttention

            spec.submodules.self_attention.submodules.core_attention = SDPAttention
    with torch.random.fork_rng(devices=[]):  # megatron may draw from the global RNG
        model = GPTModel(config, spec, pre_process=True, post_process=True,
                         **convert.gpt_model_kwargs_from_hf(hf_config, tp=tp))
    model.to(device)
    norms_in_model_dtype(model, dtype)
    missing, unexpected = model.load_state_dict(shard, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"Megatron model vs converted weights: missing {missing}, unexpected {unexpected}")
    return model


def norms_in_model_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the gains of the local spec's norms (torch.nn.RMSNorm / LayerNorm, which megatron's
    `WrappedTorchNorm` builds in torch's default fp32 whatever `params_dtype` says) to `dtype`.

    Why: with bf16 activations and an fp32 gain, `torch.rms_norm` cannot use its fused kernel
    and warns on every layer. The learner's bf16 model now holds its gains as transformers holds
    them in a bf16 checkpoint (Llama/Qwen RMSNorm: a bf16 `weight`, the normalisation computed in
    fp32). torch's fused kernel also computes in fp32 and rounds once; transformers rounds the
    normalised value to bf16 before the gain, so the two differ by at most about one bf16 step
    (tests/test_learner.py::test_bf16_norms_hold_bf16_gains_and_match_transformers). The fp32
    masters the optimizer keeps, and the weights sent to the engines, are not touched."""
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype)
