"""Server-side expert loader: a MoE layer's fused experts written in place, INSIDE an SGLang server.

qurl's weight sync sends a MoE layer's experts fused the way SGLang's `FusedMoE` holds them
(qurl/quant/experts.py `fuse_experts`): `model.layers.N.mlp.experts.w13_weight` [E, 2I, H] (each
expert's gate rows, then its up rows), `w2_weight` [E, H, I], and for int8 / fp8 the per-channel
scales `w13_weight_scale` [E, 2I, 1], `w2_weight_scale` [E, H, 1]. SGLang 0.5.23 cannot load
those names itself:
- its Qwen3-MoE `load_weights` maps only per-expert checkpoint names to its expert loader
  (`models/qwen3_moe.py:1235-1258`); a fused name falls through to the generic branch, which calls
  `FusedMoE.weight_loader(param, loaded_weight)` (`qwen3_moe.py:1271-1274`) without the
  `weight_name`, `shard_id` and `expert_id` it requires
  (`layers/moe/fused_moe_triton/layer.py:1163`): "FusedMoE.weight_loader() missing 3 required
  positional arguments";
- per-expert names load in bf16, but an 8-bit server has lost the expert loaders after its
  first load: `W8A8Int8MoEMethod.process_weights_after_loading` re-wraps `w13_weight`, `w2_weight`
  and their scales as plain Parameters (`layers/quantization/w8a8_int8.py:312-323`; `w8a8_fp8.py`
  `W8A8FP8MoEMethod`, 272-280, the same), so `param.weight_loader` raises "'Parameter' object has
  no attribute 'weight_loader'" (`qwen3_moe.py:1249`).

What this does instead. Each fused expert tensor is copied into the parameter of the same name,
in place (every `data_ptr` kept, as qurl's dense restore keeps them: CUDA graphs replay the
addresses they captured), when the parameter holds exactly that layout: same shape and dtype,
and a layer whose post-processing leaves the experts as loaded. On SGLang's generic CPU path
that is every bf16, `w8a8_int8` and `w8a8_fp8` MoE layer (the bf16 and int8 / fp8 methods only
re-wrap the storage; tests/test_sglang_real_moe.py reads the bytes back). Anything else is
refused in one line rather than written in a layout this module does not know: a TP > 1 cut
(the parameter holds [E, 2I/tp, H]), an Intel AMX layer (`use_intel_amx_backend`: its weights
are repacked for the AMX kernels, `_amx_process_weight_after_loading`), a shape or dtype that
differs.

Per-expert verification reads the same parameters back: qurl/engines/sglang/inside/apply.py
`targets_of` resolves a digest key `<name>@expert<e>` (qurl/weights/digest.py) to the view
`param[e]`, so a single expert's wrong rows or scales are named.

This module imports only torch and qurl's torch-only modules (it runs in the server process).
"""
from __future__ import annotations

import torch

from qurl.weights.digest import expert_sliced


def is_fused_expert_tensor(name: str) -> bool:
    """A fused expert weight or its scales (`…mlp.experts.w13_weight[_scale]`, `w2_…`)."""
    return expert_sliced(name)


def load_fused_experts(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Copy every fused expert tensor of `weights` into the parameter of its name, in place;
    ValueError (one line) for a tensor this server does not hold in that exact layout."""
    if not weights:
        return
    params = dict(model.named_parameters())
    for name, t in weights:
        p = params.get(name)
        if p is None:
            raise ValueError(f"{name}: this server has no parameter {name}")
        layer = model.get_submodule(name.rsplit(".", 1)[0])
        if getattr(layer, "use_intel_amx_backend", False):
            raise ValueError(f"{name}: the layer's experts are repacked for Intel AMX kernels; "
                             "qurl's expert loader writes only SGLang's loading layout")
        if tuple(p.shape) != tuple(t.shape) or p.dtype != t.dtype:
            raise ValueError(f"{name}: the server holds {tuple(p.shape)} {p.dtype}, qurl sent "
                             f"{tuple(t.shape)} {t.dtype} (qurl's expert loader is built for TP 1 "
                             "and SGLang's loading layout)")
        with torch.no_grad():
            p.data.copy_(t.to(p.device))
