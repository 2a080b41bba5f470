"""Start the learner's ranks for a command: under torchrun, as spawned processes, or in-process.

`qurl train` with learner.tp = N on one machine spawns N processes (gloo on CPU), each running the
same loop; rank 0 is the controller (engine, data, run dir). Under torchrun (RANK/WORLD_SIZE set, the
multi-node path that `qurl launch` prints) this process is already one rank. With one rank the loop
runs in this process. Rank 0's return value is handed back to the caller.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch.multiprocessing as mp

from qurl.config import Config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, fn: Callable, cfg: Config, world: int, port: int, kwargs: dict,
           queue: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    result = fn(cfg, rank=rank, world_size=world, **kwargs)
    if rank == 0:
        queue.put(result)


def launch(fn: Callable[..., Any], cfg: Config, **kwargs: Any) -> Any:
    """Run fn(cfg, rank=, world_size=, **kwargs) on every learner rank; return rank 0's result."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return fn(cfg, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                  **kwargs)
    world = cfg.learner.tp  # one machine without torchrun: one rank per TP shard (DP = 1)
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        return fn(cfg, rank=0, world_size=1, **kwargs)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_child, args=(fn, cfg, world, free_port(), kwargs, queue), nprocs=world,
                       join=True, start_method="spawn")
    return queue.get() if not queue.empty() else None
