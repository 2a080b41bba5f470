"""Server-side half of qurl's 8-bit weight updates: runs INSIDE an SGLang server process.

Why this exists. SGLang 0.5.23 serves W8A8 checkpoints (`--quantization w8a8_int8` and per-channel
`w8a8_fp8`) by loading each linear's `weight` (8-bit codes, [out, in]) and `weight_scale` (fp32,
[out, 1]) into typed parameters that carry a `weight_loader`, then `process_weights_after_loading`
replaces both by plain `Parameter`s and stores the weight transposed, [in, out], for its GEMM
(`layers/quantization/w8a8_int8.py` ~169, `w8a8_fp8.py` ~119). An online update must undo that
first, but `begin_weight_update` calls `restore_weights_before_loading`, which is a no-op for these
two methods (`layers/quantization/base_config.py`). So `update_weights_from_distributed` fails in
`model.load_weights` (`'Parameter' object has no attribute 'weight_loader'`) and the closing
`end_weight_update` transposes every weight a second time.

What qurl does. `restore_w8a8` is the missing restore. The trainer calls it, inside the update
session and before the 8-bit broadcasts, through SGLang's own extension point:
`POST /update_weights_from_tensor {"load_format": "qurl.engines.sglang_loader.restore_w8a8",
"serialized_named_tensors": [<empty list> per TP rank]}` on a server launched with
`--custom-weight-loader qurl.engines.sglang_loader.restore_w8a8` (SGLang calls it as
`fn(model, named_tensors)` on every TP rank, `model_runner_components/weight_updater.py`). For every
W8A8 linear whose weight was post-processed (it has lost its `weight_loader`), it asks the layer's
own quant method to create the loading-time parameters again (`create_weights`: the same classes,
shapes, dtypes and loader SGLang built at startup) and fills them with the current codes,
transposed back to [out, in], and scales. The layer is then exactly as it was between loading a
checkpoint and post-processing it: `update_weights_from_distributed` loads the new 8-bit codes with
SGLang's own Qwen2/Llama loaders (q/k/v and gate/up fusion, TP slicing), and `end_weight_update`
post-processes once. A layer the update does not name keeps its codes (restored, then processed).

Why this design and not the alternatives:
- the bytes still travel as 8-bit codes over the weight group (NCCL on GPUs, gloo on CPU), from a
  learner that may sit on another node, to every TP rank: `update_weights_from_tensor` with the
  data itself would need the driving process on the server's node (CUDA IPC handles) or base64
  JSON bodies, and the async pipeline's controller and the sync loop's learner are not there;
- a model class of our own (`SGLANG_EXTERNAL_MODEL_PACKAGE`) would have to shadow SGLang's
  Qwen2/Llama classes, a far larger surface to keep in step with SGLang releases.
Idempotent: a layer that still has its loader (bf16, block `fp8`, or already restored) is left
alone, so calling it twice in a session, or on a server of another precision, changes nothing.

This module imports only torch (never sglang): the server imports it by the dotted path above, so
the server's Python must find qurl (the Docker image installs it; the CPU tests put the project on
PYTHONPATH).
"""
from __future__ import annotations

from typing import Any

import torch

# SGLang quant methods whose process_weights_after_loading drops the loaders and transposes.
RESTORED_METHODS = ("W8A8Int8LinearMethod", "W8A8Fp8LinearMethod")
LOAD_FORMAT = "qurl.engines.sglang_loader.restore_w8a8"


def _processed_w8a8_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    out = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ not in RESTORED_METHODS:
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and not hasattr(weight, "weight_loader"):
            out.append(module)
    return out


def _restore_layer(layer: torch.nn.Module) -> None:
    """Re-create the loading-time `weight` [out, in] and `weight_scale` [out, 1] of one layer."""
    weight, scale = layer.weight.data, layer.weight_scale.data  # [in, out], [out, 1] or [out]
    in_part, out_total = weight.shape
    out_parts = list(getattr(layer, "output_partition_sizes", None) or [out_total])
    if sum(out_parts) != out_total:
        out_parts = [out_total]
    with torch.device(weight.device):
        # w8a8 methods are not in SGLang's WEIGHT_LOADER_V2_SUPPORTED: the v1 loader is theirs
        layer.quant_method.create_weights(
            layer=layer, input_size_per_partition=in_part, output_partition_sizes=out_parts,
            input_size=layer.input_size, output_size=layer.output_size,
            params_dtype=layer.params_dtype, weight_loader=layer.weight_loader)
    if layer.weight.shape != (out_total, in_part) or layer.weight.dtype != weight.dtype:
        raise RuntimeError(f"qurl restore: {type(layer).__name__} rebuilt weight "
                           f"{tuple(layer.weight.shape)} {layer.weight.dtype}, held "
                           f"{tuple(weight.shape)} {weight.dtype} (transposed)")
    layer.weight.data.copy_(weight.t())
    layer.weight_scale.data.copy_(scale.reshape(layer.weight_scale.shape))


def restore_w8a8(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang custom weight loader: undo W8A8 post-processing so an update can load codes.

    `named_tensors` must be empty: this loader moves no data (the codes come over the weight group).
    """
    if named_tensors:
        raise ValueError(f"{LOAD_FORMAT} takes no tensors (got {len(named_tensors)}): "
                         "send the weights with update_weights_from_distributed")
    for layer in _processed_w8a8_layers(model):
        _restore_layer(layer)
