"""How qurl imports megatron-core: quietly, and without building torch.compile's machinery.

Two things happen at `import megatron.core` (megatron-core 0.16.1) that a qurl run does not need:

1. **Fallback warnings.** megatron-core says, with `warnings.warn` at import time, that it falls
   back because Apex (or Transformer Engine and Apex) is not installed, from six modules, each in
   the `except ImportError` around `import apex` / `import transformer_engine`:
   - "Apex is not installed. Falling back to Torch Norm" (`models/backends.py`,
     `models/gpt/gpt_layer_specs.py`);
   - "Transformer Engine and Apex are not installed. Falling back to ..." (`optimizer/__init__.py`,
     `optimizer/optimizer.py`, `optimizer/clip_grads.py`, and megatron-fsdp's
     `mixed_precision.py`), reached through `parallel_state`.
   The learner uses neither Apex nor what those modules fall back from: its local layer spec asks
   for megatron's `WrappedTorchNorm` (torch's own RMSNorm), on GPU the Transformer Engine spec
   fuses the norm into TE's linear, and the optimizer and gradient clipping are qurl's own
   (qurl/learner/distopt.py). So the messages say nothing about a qurl run. One filter, for those
   messages from megatron-core's modules only (matched by text and by the warning's module),
   silences them for the rest of the process; every other warning, megatron's included, still
   shows (tests/test_first_screen.py runs `qurl train` and fails on any warning line).

2. **torch.compile at decoration time.** `megatron/core/jit.py` sets `jit_fuser = torch.compile`,
   and the fusion modules (`fusions/fused_bias_geglu.py` and 15 others) decorate their functions
   with `@jit_fuser` at import. `torch.compile(fn)` compiles nothing until `fn` is called, but
   building its wrapper imports TorchDynamo and Inductor: about 6 of the 11 s that
   `import megatron.core` took on a 2-core CPU machine (measured: 11-14 s with it, 5-6 s without).
   qurl's learner turns every one of those fusions off (`bias_activation_fusion=False` and the
   rest, qurl/learner/build.py), so on its path the decorated functions are never called. While
   megatron-core is imported, `torch.compile` is replaced by `compile_on_first_call`, which returns
   the plain function wrapped so that its first call compiles it with the real `torch.compile` and
   the same options: what runs is what would have run, only the wrapper is built later. Only
   `jit.py` calls `torch.compile` in megatron-core 0.16.1 (`grep -rn "torch\\.compile\\b"` in its
   package), and only through `jit_fuser`, bound once at its import.

`import_megatron_core()` does both, once per process; it must run before the first megatron import:
the learner calls it in `init_learner_dist`, which every learner process runs before it builds a
model. Delete (1) when megatron-core stops warning about the absent Apex / Transformer Engine at
import, and (2) when it stops calling `torch.compile` at import (or torch builds its wrapper
without importing Dynamo).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from typing import Any, Callable, Iterator

import torch

FALLBACK_MESSAGE = r"(Transformer Engine and )?Apex (is|are) not installed\. Falling back to "
MEGATRON_MODULES = r"(megatron\.core|megatron_fsdp)(\.|$)"


def quiet_import_warnings() -> None:
    """Ignore megatron-core's import-time fallback messages (item 1 above); idempotent."""
    warnings.filterwarnings("ignore", message=FALLBACK_MESSAGE, category=UserWarning,
                            module=MEGATRON_MODULES)


@contextlib.contextmanager
def compile_on_first_call() -> Iterator[None]:
    """Within the block, `torch.compile(fn, **options)` of a plain function returns `fn` wrapped so
    that its first call compiles it (the real `torch.compile(fn, **options)`) and every call runs
    the compiled function. Modules, and anything not a plain function, go to the real
    `torch.compile` at once. Restores `torch.compile` on exit."""
    real = torch.compile

    def deferred(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(mode=...)
            return lambda fn: deferred(fn, **options)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **options)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **options))
            return compiled[0](*args, **kwargs)

        return first_call_compiles

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


def import_megatron_core() -> None:
    """Import megatron-core quietly and without importing TorchDynamo (module docstring);
    idempotent, and a no-op beyond the warning filter once megatron-core is imported."""
    quiet_import_warnings()
    if "megatron.core" in sys.modules:
        return
    with compile_on_first_call():
        import megatron.core  # noqa: F401
