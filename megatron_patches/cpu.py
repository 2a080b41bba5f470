"""Patches that let megatron-core's GPTModel run forward and backward on CPU with gloo.

megatron-core assumes CUDA in a few call sites that have plain CPU equivalents. The learner calls
`apply_cpu_patches()` once, only when it runs on CPU (no CUDA device); nothing is patched at import.
Each patch is one function below, idempotent, and tolerant of megatron-core versions where the
patched internals moved or vanished (it then logs and skips; the model build or first forward
will name what still breaks).

What the learner avoids instead of patching (so no patch exists for it):
- weight init on the GPU / through the CUDA RNG: `perform_initialization=False` and
  `use_cpu_initialization=True` (all weights are loaded from the HF checkpoint anyway);
- `get_default_causal_mask` (allocates on "cuda"): the learner passes an explicit causal mask;
- megatron's DistributedOptimizer / clip_grads (`device="cuda"` tensors in the constructor,
  `param.type() == "torch.cuda.BFloat16Tensor"` checks): the learner shards its optimizer over DP
  itself (qurl/learner/distopt.py) with plain torch.distributed collectives, so neither megatron's
  DDP wrapper nor its optimizer is used on CPU or GPU.

Patches (checked against megatron-core 0.16.1; re-check each on upgrade):

1. `patch_current_device` — `torch.cuda.current_device()` returns `torch.device("cpu")` when CUDA
   is unavailable (it raises otherwise). Why: megatron allocates with
   `device=torch.cuda.current_device()` in ~30 places on the forward/backward path (RoPE
   `inv_freq`, TP all-gather buffers in `tensor_parallel/mappings.py`, vocab-parallel layers,
   attention). Only a call that would have raised changes behaviour. Versions: 0.16.1 (and all
   earlier mcore). Delete when megatron-core allocates on the input's device (or a device getter
   such as `get_current_device()` honours CPU).
2. `patch_rng_tracker` — `CudaRNGStatesTracker` keeps CPU generator states: the module functions
   `_get_cuda_rng_state` / `_set_cuda_rng_state` read/write the default CPU generator and
   `CudaRNGStatesTracker.add` seeds a fresh CPU `torch.Generator`. Why: attention always runs under
   `get_cuda_rng_tracker().fork()` (for dropout) and `model_parallel_cuda_manual_seed` calls
   `torch.cuda.get_rng_state()`, both of which need CUDA. Versions: 0.16.1. Delete when megatron's
   RNG tracker supports CPU (or the attention stops forking when dropout is 0).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_APPLIED: set[str] = set()


def _cpu_current_device() -> torch.device:
    """Stand-in for torch.cuda.current_device() on a machine without CUDA."""
    return torch.device("cpu")


def patch_current_device() -> bool:
    """Patch 1 (see module docstring). Returns True when the patch is active."""
    if torch.cuda.is_available():
        return False  # a real device exists: megatron's calls are right as they are
    if "current_device" not in _APPLIED:
        torch.cuda._qurl_original_current_device = torch.cuda.current_device  # type: ignore[attr-defined]
        torch.cuda.current_device = _cpu_current_device
        _APPLIED.add("current_device")
    return True


def _cpu_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU stand-in for megatron's `_get_cuda_rng_state`: the default generator's state (a copy)."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    """CPU stand-in for megatron's `_set_cuda_rng_state`."""
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """CPU stand-in for `CudaRNGStatesTracker.add`: same checks, CPU generator state."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    self.states_[name] = gen.get_state()


def patch_rng_tracker() -> bool:
    """Patch 2 (see module docstring). Returns True when the patch is active."""
    if torch.cuda.is_available():
        return False
    if "rng_tracker" in _APPLIED:
        return True
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError as err:  # pragma: no cover - megatron-core layout changed
        log.warning("megatron_patches: cannot import megatron.core.tensor_parallel.random (%s)", err)
        return False
    tracker = getattr(mrandom, "CudaRNGStatesTracker", None)
    missing = [n for n in ("_get_cuda_rng_state", "_set_cuda_rng_state") if not hasattr(mrandom, n)]
    if tracker is None or missing or not hasattr(tracker, "add"):
        log.warning("megatron_patches: RNG tracker internals not found (%s); not patched",
                    missing or "CudaRNGStatesTracker.add")
        return False
    mrandom._get_cuda_rng_state = _cpu_get_rng_state
    mrandom._set_cuda_rng_state = _cpu_set_rng_state
    tracker.add = _cpu_tracker_add
    _APPLIED.add("rng_tracker")
    return True


def apply_cpu_patches() -> dict[str, bool]:
    """Apply every CPU patch (idempotent); returns {patch name: active}. No-op where CUDA exists."""
    return {"current_device": patch_current_device(), "rng_tracker": patch_rng_tracker()}
