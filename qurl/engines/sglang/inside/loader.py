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
`POST /update_weights_from_tensor {"load_format": "qurl.engines.sglang.inside.loader.restore_w8a8",
"serialized_named_tensors": [<empty list> per TP rank]}` on a server launched with
`--custom-weight-loader qurl.engines.sglang.inside.loader.restore_w8a8` (SGLang calls it as
`fn(model, named_tensors)` on every TP rank, `model_runner_components/weight_updater.py`). For every
W8A8 linear whose weight was post-processed (it has lost its `weight_loader`), it gives the layer
back its loading-time parameters — the same classes, attributes and loader SGLang built at startup
— over the SAME storage: the layer's quant method runs `create_weights` on the meta device (it
allocates nothing; only the parameter objects and their attributes are kept), and each new
parameter is re-bound to the tensor the layer holds, `weight` viewed back as [out, in] (a
transpose is a view: no byte moves) and `weight_scale` reshaped to the loader's shape. The layer
is then exactly as it was between loading a checkpoint and post-processing it:
`update_weights_from_distributed` writes the new 8-bit codes in place with SGLang's own
Qwen2/Llama loaders (q/k/v and gate/up fusion, TP slicing), and `end_weight_update`
post-processes once, again as a view of that storage. A layer the update does not name keeps its
codes (restored, then processed).

Why the storage must stay. SGLang captures CUDA graphs for decoding at startup; a graph replays
the kernel launches with the parameter ADDRESSES it saw then. A restore that allocated new
tensors (as an earlier version of this module did, through `create_weights` on the real device)
left the graphs reading the freed startup buffers after the first update: generation ran on, with
stale or garbage weights. SGLang keeps parameter identities for the same reason
(`layers/utils/common.py: copy_or_rebind_param`, used by block `fp8` post-processing, whose
`process_weights_after_loading` assigns `layer.weight.data = ...` in place); `w8a8_int8` /
`w8a8_fp8` post-processing wraps views of the loaded storage (`Parameter(weight.t())`), so with
this restore every 8-bit parameter keeps its `data_ptr` across updates
(tests/test_sglang_real.py checks it on the real server).

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
LOAD_FORMAT = "qurl.engines.sglang.inside.loader.restore_w8a8"
# delta and verified syncs (apply.py): restore + the load_weights wrapper
SYNC_LOAD_FORMAT = "qurl.engines.sglang.inside.loader.prepare_sync"
# the post-repack read-back of what the kernels read (readback.py)
KERNELS_LOAD_FORMAT = "qurl.engines.sglang.inside.loader.read_kernels"


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


def _loading_view(name: str, held: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """The post-processed tensor `held` as a view with the loading-time shape of `want`:
    `weight` is held transposed, [in, out] (always: a square one too), scales as loaded."""
    view = held.t() if name == "weight" and held.dim() == 2 else held
    if tuple(view.shape) != tuple(want.shape) and view.numel() == want.numel() \
            and view.is_contiguous():
        view = view.view(want.shape)  # a scale held [out] for a loader that wants [out, 1]
    if tuple(view.shape) != tuple(want.shape):
        raise RuntimeError(f"qurl restore: cannot view the held {name} {tuple(held.shape)} as "
                           f"the loading-time {tuple(want.shape)}")
    return view


def _restore_layer(layer: torch.nn.Module) -> None:
    """Give one layer back its loading-time `weight` [out, in] and `weight_scale` [out, 1]
    parameters (classes, attributes, weight loader) over the storage it already holds."""
    held = {n: p.data for n, p in layer.named_parameters(recurse=False)}
    weight = held["weight"]  # [in, out] (a view of the loaded [out, in] storage)
    in_part, out_total = weight.shape
    out_parts = list(getattr(layer, "output_partition_sizes", None) or [out_total])
    if sum(out_parts) != out_total:
        out_parts = [out_total]
    with torch.device("meta"):  # parameter objects only: nothing is allocated
        # w8a8 methods are not in SGLang's WEIGHT_LOADER_V2_SUPPORTED: the v1 loader is theirs
        layer.quant_method.create_weights(
            layer=layer, input_size_per_partition=in_part, output_partition_sizes=out_parts,
            input_size=layer.input_size, output_size=layer.output_size,
            params_dtype=layer.params_dtype, weight_loader=layer.weight_loader)
    for name, fresh in list(layer.named_parameters(recurse=False)):
        if not fresh.is_meta:
            continue
        if name not in held or held[name].dtype != fresh.dtype:
            raise RuntimeError(f"qurl restore: {type(layer).__name__}.{name}: the quant method "
                               f"rebuilt {fresh.dtype} {tuple(fresh.shape)}, the layer held "
                               f"{held[name].dtype if name in held else 'nothing'}")
        data = _loading_view(name, held[name], fresh)
        # a parameter of the rebuilt class over the held storage, with the rebuilt attributes
        rebound = torch.nn.Parameter._make_subclass(type(fresh), data, False)
        rebound.__dict__.update(fresh.__dict__)
        setattr(layer, name, rebound)


def restore_w8a8(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang custom weight loader: undo W8A8 post-processing so an update can load codes.

    `named_tensors` must be empty: this loader moves no data (the codes come over the weight group).
    """
    if named_tensors:
        raise ValueError(f"{LOAD_FORMAT} takes no tensors (got {len(named_tensors)}): "
                         "send the weights with update_weights_from_distributed")
    for layer in _processed_w8a8_layers(model):
        _restore_layer(layer)


def prepare_sync(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang custom weight loader called at the start of every qurl update session on a server
    launched with `--custom-weight-loader qurl.engines.sglang.inside.loader.prepare_sync`: the W8A8
    restore above, then qurl's delta / verification hook (apply.py).
    Never raises (that would kill the scheduler): a failure is reported by the next load."""
    from qurl.engines.sglang.inside.apply import prepare

    prepare(model, named_tensors, restore_w8a8)


def read_kernels(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang custom weight loader opening qurl's read-back session (first act after
    `begin_weight_update`, no restore): the session's closing repack becomes a no-op, so the
    `qurl.sync.kernels` bucket that follows reads the tensors the kernels read
    (readback.py). Never raises."""
    from qurl.engines.sglang.inside.apply import prepare_read_back

    prepare_read_back(model, named_tensors)
