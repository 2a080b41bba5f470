"""Patches that let megatron-core's MoE layer (router + SequentialMLP experts, allgather token
dispatcher) run without Transformer Engine, as on CPU (and on a GPU image without TE), and
quietly on torch 2.13.

The learner calls `apply_moe_patches()` when it builds a mixture-of-experts GPTModel
(qurl/learner/build.py), on CPU or GPU; nothing is patched at import. Each patch is idempotent,
a no-op where it is not needed (patch 1 where Transformer Engine imports, patch 2 on a torch
without the renamed collectives), and logs and skips when the patched internals moved.

What the learner avoids instead of patching: the TE-only fused kernels (`moe_router_fusion`,
`moe_permute_fusion`, fused aux loss) are off in its config (qurl/models/moe.py), and megatron
guards each of them with `HAVE_TE`; the allgather token dispatcher uses plain torch.distributed
collectives (gloo on CPU), and its `tensor.cpu()` of the per-expert token counts is a copy on CPU.
With expert parallelism (learner.ep > 1) that dispatcher all-gathers tokens and reduce-scatters
expert outputs over the TP x EP group (`gather_from_sequence_parallel_region`,
`reduce_scatter_to_sequence_parallel_region`); torch 2.13's gloo runs both
(`all_gather_into_tensor`, `reduce_scatter_tensor`), so expert parallelism on CPU needs no patch
of its own beyond patch 2's renaming. (The alltoall dispatcher's `all_to_all_single` would run
on gloo too, but the allgather one needs no device-to-host sync of per-rank token counts.)

Patches (checked against megatron-core 0.16.1; re-check each on upgrade):

1. `patch_router_gemm` — `megatron.core.transformer.moe.moe_utils.te_general_gemm = None` when
   it is undefined. Why: `moe_utils` imports `te_general_gemm` from its TE extension inside a
   `try` whose `except ImportError` defines only `HAVE_TE = False`, yet the router's
   `RouterGatingLinearFunction.forward/backward` test `if te_general_gemm is not None` unguarded,
   so without TE the first router call raises `NameError: name 'te_general_gemm' is not defined`.
   With the name bound to None megatron takes its own branch: `torch.mm` in the router dtype
   (fp32 here), the same product. Versions: 0.16.1. Delete when megatron-core binds the name to
   None in that `except` (or guards the call with `HAVE_TE`).
2. `patch_collective_names` — `megatron.core.tensor_parallel.mappings.dist_all_gather_func` /
   `dist_reduce_scatter_func` = `torch.distributed.all_gather_single` / `reduce_scatter_single`
   where torch has those names. Why: mappings.py (0.16.1, lines 10-19) binds them at import to
   `all_gather_into_tensor` / `reduce_scatter_tensor`, which torch 2.13 deprecates with a
   FutureWarning on every rank at the first call from each call site (mappings.py lines 92, 142,
   182: the token dispatcher's gather and reduce-scatter at TP > 1 or EP > 1). The new names take
   the same arguments (output, input, group, async_op; reduce-scatter also op) and run the same
   collective. A no-op on a torch without the new names (the old ones do not warn there).
   Versions: megatron-core 0.16.1 with torch >= 2.13. Delete when megatron-core picks the
   non-deprecated names itself.
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


def patch_collective_names() -> bool:
    """Patch 2 (see module docstring). Returns True when the patch is active."""
    import torch.distributed as dist

    if "collective_names" in _APPLIED:
        return True
    gather, scatter = getattr(dist, "all_gather_single", None), getattr(dist, "reduce_scatter_single", None)
    if gather is None or scatter is None:
        return False  # an older torch: megatron's names are current there
    try:
        from megatron.core.tensor_parallel import mappings
    except ImportError as err:  # pragma: no cover - megatron-core layout changed
        log.warning("megatron_patches: cannot import megatron.core.tensor_parallel.mappings (%s)", err)
        return False
    if not (hasattr(mappings, "dist_all_gather_func") and hasattr(mappings, "dist_reduce_scatter_func")):
        log.warning("megatron_patches: mappings.dist_all_gather_func / dist_reduce_scatter_func "
                    "not found; not patched")
        return False
    mappings.dist_all_gather_func = gather
    mappings.dist_reduce_scatter_func = scatter
    _APPLIED.add("collective_names")
    return True


def apply_moe_patches() -> dict[str, bool]:
    """Apply every MoE patch (idempotent); returns {patch name: active}."""
    return {"router_gemm": patch_router_gemm(), "collective_names": patch_collective_names()}
