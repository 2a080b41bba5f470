"""Read back what an SGLang server's kernels read: AFTER the repack, outside qurl's restore.

Why. qurl's in-session check (apply.py `verify`) hashes the weights inside an update session,
after qurl's W8A8 restore, in the loading layout ([out, in]). Then `end_weight_update` runs every
quant method's `process_weights_after_loading` (the "repack"), and generation reads what THAT
produced. The in-session check trusts two things it never sees: that the repack is layout-only
(verl#7986: a repack left a layer that passed its check holding wrong values), and that qurl's
restore inverts it (a square weight viewed the wrong way round hashes right and computes wrong).
This module checks the tensors the kernels use, in the layout the kernels use, after the last
repack a sync runs.

How (SGLang 0.5.23). No endpoint runs custom code outside an update session:
`/update_weights_from_tensor` and `/update_weights_from_distributed` answer `{"success": false,
"... must run between begin_weight_update() and end_weight_update()"}` without calling anything
(scheduler_components/weight_updater.py; the scheduler lives), `/get_weights_by_name` answers 400
for Qwen2, and `/weights_checker` hashes dequantized values with a GPU-only hash the learner
cannot recompute. So the read-back is its own short session, arranged to change nothing:

1. `begin_weight_update` calls `restore_weights_before_loading`, a no-op for every linear method
   qurl serves (w8a8_int8, w8a8_fp8, block fp8, bf16: `base_config.py`): the layers are exactly
   as the kernels read them;
2. the custom loader `qurl.engines.sglang.inside.loader.read_kernels` (never raises; apply.py
   `prepare_read_back`, which calls `skip_next_repack` below) makes this session's closing
   `process_weights_after_loading` a one-shot no-op on every layer
   (qurl restores nothing in this session, so a W8A8 repack would transpose a second time);
3. one bucket holding only the control chunk `qurl.sync.kernels` (the same message as
   `qurl.sync.verify`) reaches apply.py's `load_weights` wrapper, which calls `check_kernels`: each
   HF tensor is recomputed from the kernel's tensor and hashed like the sender's chunk, and every
   region that holds it (a tied lm_head too) must match; a difference fails the call with
   `qurl-mismatch: ["<name> (kernel layout)", ...]` (the reply comes back to qurl like the in-session
   check's; at TP > 1 the ranks merge their outcomes the same way);
4. `end_weight_update`: the skipped repack leaves every tensor as read. A one-shot left over by a
   session that never ended is removed by the next `prepare` (`clear_skips`).

The kernel layout per quant method, from SGLang's source (`process_weights_after_loading` and the
module flags it branches on, read from `sys.modules`; nothing here imports sglang):
- `W8A8Int8LinearMethod`: weight held transposed, [in, out] (GPU path); on a CPU engine
  (`_is_cpu`) arm64 keeps [out, in]; AMX packs it (VNNI): unknown here;
- `W8A8Fp8LinearMethod`: weight transposed, scale as loaded; on ROCm (`_is_fp8_fnuz`) codes and
  scales are renormalized to e4m3fnuz: unknown here;
- `Fp8LinearMethod` (block fp8): weight and `weight_scale_inv` in place (ROCm fnuz or AMX: unknown);
- anything else (bf16 linears, embeddings, norms): as held (AMX-packed layers: unknown).
The transposition is taken from the method, never from the parameter's shape or loader: a
weight left in the loading layout where the kernel expects [in, out] is read as the kernel reads
it, and a square one shows as wrong values. A layout this module does not know fails the check
("kernel layout unknown") rather than passing unseen: turn the check off with
deploy.sync.verify_kernels_every = 0 there. Derived copies some kernels keep beside the parameters
(Hopper's `_block_fp8_bf16_weight`, aiter's `_ptpc_weight`) are not read.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import torch

log = logging.getLogger(__name__)
KERNEL_MARK = " (kernel layout)"
_SKIP = "_qurl_skip_repack"  # instance attribute on a quant method: the one-shot no-op


def _flag(method: Any, name: str) -> bool:
    """A module-level flag of the SGLang module that defines `method`'s class (e.g. `_is_cpu`)."""
    return bool(getattr(sys.modules.get(type(method).__module__), name, False))


def kernel_orientation(layer: torch.nn.Module, method: Any) -> str:
    """How `layer.weight` is held for the kernel: "t" ([in, out]), "as-is", or why unknown."""
    kind = type(method).__name__
    if getattr(layer, "use_intel_amx_backend", False):
        return "unknown: AMX-packed"
    if kind == "W8A8Int8LinearMethod":
        if _flag(method, "_is_cpu"):
            return "as-is" if _flag(method, "_is_cpu_arm64") else "unknown: CPU engine"
        return "t"
    if kind in ("W8A8Fp8LinearMethod", "Fp8LinearMethod") and _flag(method, "_is_fp8_fnuz"):
        return "unknown: e4m3fnuz renormalized"
    if kind == "W8A8Fp8LinearMethod":
        return "t"
    return "as-is"


def kernel_params(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """({parameter name: the kernel's tensor viewed in the loading orientation, [out, ...]}
    (views, nothing copied), {parameter name: why its layout is unknown})."""
    params = {n: p.data for n, p in model.named_parameters()}
    unknown: dict[str, str] = {}
    for mname, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        how = kernel_orientation(module, method)
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if how.startswith("unknown"):
                unknown[full] = how
            elif how == "t" and pname == "weight" and p.dim() == 2:
                params[full] = p.data.t()
    return params, unknown


def skip_next_repack(model: torch.nn.Module) -> None:
    """Make the next `process_weights_after_loading` of every quantized layer a no-op (step 2
    of the module docstring: this read-back session must leave every tensor as it reads it)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            _skip_once(method, module)


def _skip_once(method: Any, layer: torch.nn.Module) -> None:
    """Make the next `process_weights_after_loading(layer)` a no-op (a quant method may serve
    several layers: each is skipped once, then the method's own function is back)."""
    pending = method.__dict__.get(_SKIP, (None,))[0]
    if pending is None:
        pending = set()
        original = method.process_weights_after_loading
        before = method.__dict__.get("process_weights_after_loading")  # an instance's own

        def skip(lay: torch.nn.Module) -> None:
            if id(lay) in pending:
                pending.discard(id(lay))
            else:
                original(lay)
            if not pending:
                clear_method(method)
        method.__dict__[_SKIP] = (pending, before)
        method.process_weights_after_loading = skip
    pending.add(id(layer))


def clear_method(method: Any) -> None:
    """Put back the method's own `process_weights_after_loading` (what was there before)."""
    left = method.__dict__.pop(_SKIP, None)
    if left is not None:
        method.__dict__.pop("process_weights_after_loading", None)
        if left[1] is not None:
            method.__dict__["process_weights_after_loading"] = left[1]


def clear_skips(model: torch.nn.Module) -> None:
    """Remove one-shots left by a read-back session that never reached its end (prepare calls it
    first, so a sync's closing repack always runs)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            clear_method(method)
