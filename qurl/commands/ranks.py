"""Start the learner's ranks for a command: under torchrun, as spawned processes, or in-process.

`qurl train` with learner.tp × learner.dp = N on one machine spawns N processes (gloo on CPU),
each running the same loop; rank 0 is the controller (engine, data, run dir). Under torchrun
(RANK/WORLD_SIZE set, the multi-node path that `qurl launch` prints) this process is already one
rank. With one rank the loop runs in this process. Rank 0's return value is handed back to the caller.
Every rank runs with qurl's NCCL settings (qurl/weights/nccl_env.py), set before its first
communicator.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from qurl.config import LearnerConfig
from qurl.learner.dist import free_port, spawn
from qurl.weights.nccl_env import apply_nccl_defaults


def _call(rank: int, world_size: int, fn: Callable, args: tuple, kwargs: dict) -> Any:
    return fn(*args, rank=rank, world_size=world_size, **kwargs)


def run_ranks(fn: Callable[..., Any], learner: LearnerConfig, *args: Any, **kwargs: Any) -> Any:
    """Run fn(*args, rank=, world_size=, **kwargs) on every rank of the learner (learner.tp x
    learner.dp of them); return rank 0's result. First gives this process qurl's NCCL settings
    where unset (qurl/weights/nccl_env.py), before any communicator: spawned ranks, workers and
    SGLang servers inherit them."""
    apply_nccl_defaults()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _call(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), fn, args, kwargs)
    world = learner.tp * learner.dp  # one machine without torchrun
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return _call(0, 1, fn, args, kwargs)
    return spawn(_call, world, fn, args, kwargs)[0]
