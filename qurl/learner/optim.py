"""The learner's learning-rate schedule.

`lr_at`, per learner step k = 0, 1, ...: linear warmup `lr·(k+1)/warmup_steps` for k < warmup_steps,
then `constant` lr or `cosine` decay `lr·½(1+cos(π·p))`, p = (k−warmup)/(total−warmup). The curve
is qurl/algo/schedule.py's `warmup_then_decay` (floor 0), which the supervised warm start
(qurl/models/warmstart.py) runs too.
"""
from __future__ import annotations

from qurl.algo.schedule import warmup_then_decay
from qurl.config import OptimConfig


def lr_at(optim: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate of learner step `step` (0-based) in a run of `total_steps` steps."""
    return warmup_then_decay(step, total_steps, lr=optim.lr, warmup=optim.warmup_steps,
                             schedule=optim.schedule)
