"""Patches that let megatron-core's MoE layer (router + SequentialMLP experts) run without
Transformer Engine, as on CPU (and on a GPU image without TE).

The learner calls `apply_moe_patches()` when it builds a mixture-of-experts GPTModel
(qurl/learner/build.py), on CPU or GPU; nothing is patched at import. Each patch is idempotent,
a no-op where Transformer Engine imports, and logs and skips when the patched internals moved.

What the learner avoids instead of patching: the TE-only fused kernels (`moe_router_fusion`,
`moe_permute_fusion`, fused aux loss) are off in its config (qurl/models/moe.py), and megatron
guards each of them with `HAVE_TE`; the allgather token dispatcher uses plain torch.distributed
collectives (gloo on CPU), and its `tensor.cpu()` of the per-expert token counts is a copy on CPU.

Patches (checked against megatron-core 0.16.1; re-check each on upgrade):

1. `patch_router_gemm` — `megatron.core.transformer.moe.moe_utils.te_general_gemm = None` when
   it is undefined. Why: `moe_utils` imports `te_general_gemm` from its TE extension inside a
   `try` whose `except ImportError` defines only `HAVE_TE = False`, yet the router's
   `RouterGatingLinearFunction.forward/backward` test `if te_general_gemm is not None` unguarded,
   so without TE the first router call raises `NameError: name 'te_general_gemm' is not defined`.
   With the name bound to None megatron takes its own branch: `torch.mm` in the router dtype
   (fp32 here), the same product. Versions: 0.16.1. Delete when megatron-core binds the name to
   None in that `except` (or guards the call with `HAVE_TE`).
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_APPLIED: set[str] = set()


def patch_router_gemm() -> bool:
    """Patch 1 (see module docstring). Returns True when the patch is active."""
    if "router_gemm" in _APPLIED:
        return True
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError as err:  # pragma: no cover - megatron-core layout changed
        log.warning("megatron_patches: cannot import megatron.core.transformer.moe.moe_utils (%s)", err)
        return False
    if hasattr(moe_utils, "te_general_gemm"):
        return False  # Transformer Engine imported: megatron's own name stands
    if not hasattr(moe_utils, "RouterGatingLinearFunction"):
        log.warning("megatron_patches: moe_utils.RouterGatingLinearFunction not found; not patched")
        return False
    moe_utils.te_general_gemm = None
    _APPLIED.add("router_gemm")
    return True


def apply_moe_patches() -> dict[str, bool]:
    """Apply every MoE patch (idempotent); returns {patch name: active}."""
    return {"router_gemm": patch_router_gemm()}
