"""The megatron-core import warnings qurl silences, and why.

megatron-core 0.16.1 says, with `warnings.warn` at import time, that it falls back because Apex
(or Transformer Engine and Apex) is not installed, from six modules, each in the
`except ImportError` around `import apex` / `import transformer_engine`:
- "Apex is not installed. Falling back to Torch Norm" (`models/backends.py`,
  `models/gpt/gpt_layer_specs.py`);
- "Transformer Engine and Apex are not installed. Falling back to ..." (`optimizer/__init__.py`,
  `optimizer/optimizer.py`, `optimizer/clip_grads.py`, and megatron-fsdp's
  `mixed_precision.py`), reached through `parallel_state`.
The learner uses neither Apex nor what those modules fall back from: its local layer spec asks
for megatron's `WrappedTorchNorm` (torch's own RMSNorm), on GPU the Transformer Engine spec
fuses the norm into TE's linear, and the optimizer and gradient clipping are qurl's own
(qurl/learner/distopt.py). So the messages say nothing about a qurl run, and they were printed
once per module and rank before the first progress line.

`quiet_import_warnings()` installs one filter, for those fallback messages from megatron-core's
modules only (matched by text and by the warning's module), for the rest of the process. It must
run before the first megatron import: the learner calls it in `init_learner_dist`, which every
learner process runs before it builds a model. Every other warning, megatron's included, still
shows (tests/test_first_screen.py runs `qurl train` and fails on any warning line).

Versions: megatron-core 0.16.1 (the messages and modules above). Delete when megatron-core stops
warning about the absent Apex / Transformer Engine at import (it already says nothing when they
import).
"""
from __future__ import annotations

import warnings

FALLBACK_MESSAGE = r"(Transformer Engine and )?Apex (is|are) not installed\. Falling back to "
MEGATRON_MODULES = r"(megatron\.core|megatron_fsdp)(\.|$)"


def quiet_import_warnings() -> None:
    """Ignore megatron-core's import-time fallback messages (module docstring); idempotent."""
    warnings.filterwarnings("ignore", message=FALLBACK_MESSAGE, category=UserWarning,
                            module=MEGATRON_MODULES)
