"""What every learner rank imports before its first step, imported once by the fork server that
`qurl.learner.dist.spawn` starts ranks from.

A rank started with the *spawn* method is a fresh interpreter: before it can build a model it
imports torch, megatron-core (through `megatron_patches.imports`) and transformers' model code,
about 13 CPU-seconds on a 2-core CPU machine (measured: torch 4.0 s, + megatron-core 8.1 s,
torch + transformers' Qwen3-MoE and Llama classes 10 s, one process each). `spawn` instead starts
ranks with the *forkserver* method: one server process imports this module once, and each rank is
a fork of it, so a job of N ranks (or a test file that spawns a few jobs) pays the imports once.

What makes the fork safe: importing these modules starts no thread and touches no device (CUDA is
initialised by the first CUDA call in a rank, after the fork), and torch's intra-op thread pool
is created on the first parallel op, also in the rank. Each rank still unpickles its function,
which imports that function's own module, and applies the caller's environment (`dist.spawn`
passes it: the server's environment is the one it started with).
"""
from __future__ import annotations

import torch  # noqa: F401

from megatron_patches.imports import import_megatron_core

import_megatron_core()

import megatron.core.models.gpt  # noqa: E402,F401  (the learner's model classes)
import transformers.modeling_utils  # noqa: E402,F401  (what every HF model class imports)
