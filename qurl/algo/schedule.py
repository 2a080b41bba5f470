"""The learning-rate curve of qurl's two trainers: the RL learner (qurl/learner/optim.py `lr_at`,
from `[optim]`) and the supervised warm start of a built base model (qurl/models/warmstart.py).

`warmup_then_decay`, per step k = 0, 1, ... of `total_steps`: linear warmup `lr·(k+1)/warmup` for
k < warmup, then `constant` lr or `cosine` decay `lr·(floor + (1−floor)·½(1+cos(π·p)))`,
p = min(1, (k−warmup)/max(1, total−warmup)): down to floor·lr. The learner's floor is 0 (its
curve is `lr·½(1+cos(π·p))`, to the bit), the warm start's a tenth.
"""
from __future__ import annotations

import math


def warmup_then_decay(step: int, total_steps: int, *, lr: float, warmup: int, schedule: str,
                      floor: float = 0.0) -> float:
    """Learning rate of step `step` (0-based) of `total_steps` (module docstring)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        span = max(1, total_steps - warmup)
        p = min(1.0, (step - warmup) / span)
        return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p)))
    raise ValueError(f"optim.schedule={schedule!r}: must be constant or cosine")
