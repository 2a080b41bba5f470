"""CPU thread placement: how many torch threads each qurl process on a node computes with."""
from __future__ import annotations

import os

from qurl.config import Config


def busy_processes(cfg: Config, world_size: int, *, workers: bool = True) -> int:
    """qurl processes computing at the same time on this node: the learner's ranks here
    (nproc_per_node across nodes), plus the local rollout workers when their generation overlaps
    training (async with η ≥ 1 or several workers, on CPU; not with workers=False)."""
    import torch

    r = cfg.rollout
    ranks = cfg.learner.nproc_per_node if cfg.learner.nnodes > 1 else world_size
    overlap = (workers and r.mode == "async" and r.workers == "local"
               and not torch.cuda.is_available() and (r.max_staleness > 0 or r.num_workers > 1))
    return ranks + (r.num_workers if overlap else 0)


def set_threads(cfg: Config, busy: int = 1) -> int:
    """Pin torch's CPU threads for this process and return the count: run.torch_threads when set,
    else (auto) this node's cores divided among the `busy` processes computing at once
    (`busy_processes`). So the sync loop runs generation and training each on every core, and an
    async run splits the cores between learner and workers: `qurl compare` gives every arm the
    same machine."""
    import torch

    n = cfg.run.torch_threads
    if n <= 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        n = max(1, (cores or 1) // max(1, busy))
    torch.set_num_threads(n)
    return n
