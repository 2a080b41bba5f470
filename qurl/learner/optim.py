"""The learner's learning-rate schedule.

`lr_at`, per learner step k = 0, 1, ...: linear warmup `lr·(k+1)/warmup_steps` for k < warmup_steps,
then `constant` lr or `cosine` decay `lr·½(1+cos(π·p))`, p = (k−warmup)/(total−warmup).
"""
from __future__ import annotations

import math

from qurl.config import OptimConfig


def lr_at(optim: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate of learner step `step` (0-based) in a run of `total_steps` steps."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    if optim.schedule == "cosine":
        span = max(1, total_steps - optim.warmup_steps)
        p = min(1.0, (step - optim.warmup_steps) / span)
        return optim.lr * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"optim.schedule={optim.schedule!r}: must be constant or cosine")
