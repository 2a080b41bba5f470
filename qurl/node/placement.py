"""Where qurl's processes compute: learner ranks per node, CPU threads, the GPU of a rollout worker.

CPU threads. torch's OpenMP threads spin in barriers, so two processes that each take every core
of a node run ~25x slower than one. A node's cores are therefore divided among the qurl processes
computing at the same time on it (`busy_processes`): the learner's ranks on this node, plus the
local rollout workers when their generation overlaps training (asynchronous rollout on CPU with
η >= 1 or several workers). `deploy.torch_threads` overrides the division. The sync loop
generates and trains one after the other, so both get every core; an async run splits them, so
`qurl compare` gives every arm the same machine. The controller decides its workers' count once
(`learner_threads`) and passes it on their command line; a worker never recomputes it.

GPUs. On a learner node the learner's ranks hold GPUs 0..P-1; async workers with a local engine
take the next ones in slot order (`worker_gpu`). SGLang servers that qurl launches on that node
(the sync loop's deploy.engines servers, or async worker i's one server) take sglang.tp GPUs each,
after the learner's, in server (slot) order (`sglang_base_gpus`, passed to each server as SGLang's
`--base-gpu-id`: its TP rank r computes on GPU base + r, counted within CUDA_VISIBLE_DEVICES).
Unlike a local worker engine, a server never shares a GPU: its memory pool takes
--mem-fraction-static of the device (0.9 by default) and its NCCL ranks in the weight group must
sit on GPUs of their own, so too few GPUs is an error, not a wrap-around.
"""
from __future__ import annotations

import os

import torch

from qurl.config import (ConfigError, DeployConfig, LearnerConfig, RanksDeployConfig, RolloutConfig,
                         SGLangConfig)


def learner_ranks_per_node(learner: LearnerConfig, ranks: RanksDeployConfig) -> int:
    """The learner's ranks on each learner node: deploy.ranks.nproc_per_node, or (0, the default)
    learner.tp x learner.dp / deploy.ranks.nnodes, which must then divide evenly."""
    world = learner.tp * learner.dp
    if ranks.nproc_per_node:
        return ranks.nproc_per_node
    if world % ranks.nnodes:
        raise ConfigError(f"deploy.ranks.nnodes={ranks.nnodes}: does not divide the learner's "
                          f"learner.tp*learner.dp={world} ranks; set deploy.ranks.nproc_per_node")
    return world // ranks.nnodes


def busy_processes(learner: LearnerConfig, rollout: RolloutConfig, deploy: DeployConfig, *,
                   workers: bool = True) -> int:
    """qurl processes computing at once on a learner node: its learner ranks, plus the local
    rollout workers when their generation overlaps training (not counted with workers=False)."""
    overlap = (workers and deploy.rollout == "workers" and not torch.cuda.is_available()
               and (rollout.max_staleness > 0 or deploy.engines > 1))
    return learner_ranks_per_node(learner, deploy.ranks) + (deploy.engines if overlap else 0)


def threads_for(deploy: DeployConfig, busy: int) -> int:
    """deploy.torch_threads when set, else this machine's cores divided among `busy` processes."""
    if deploy.torch_threads > 0:
        return deploy.torch_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, busy))


def learner_threads(learner: LearnerConfig, rollout: RolloutConfig, deploy: DeployConfig, *,
                    workers: bool = True) -> int:
    """The thread count of a learner rank, and of the local workers its controller starts (they
    get the same share): this node's cores over `busy_processes`."""
    return threads_for(deploy, busy_processes(learner, rollout, deploy, workers=workers))


def set_threads(n: int) -> int:
    """Pin torch's CPU threads for this process; returns n."""
    torch.set_num_threads(n)
    return n


def worker_gpu(learner: LearnerConfig, deploy: DeployConfig, slot: int, n_gpus: int) -> int:
    """The GPU of async worker `slot`'s local engine on the controller's node: the learner's
    ranks hold GPUs 0..P-1 there, workers take the next ones in slot order, wrapping around
    (and sharing) when the node has too few — except with deploy.sync.worker_backend=nccl, whose group
    of the controller (GPU 0) and the workers needs a GPU per member: too few is then an error."""
    if n_gpus < 1:
        raise ValueError(f"n_gpus={n_gpus}: a worker GPU needs at least one GPU")
    first = learner_ranks_per_node(learner, deploy.ranks)
    if deploy.sync.worker_backend == "nccl" and first + slot >= n_gpus:
        raise ValueError(f"deploy.sync.worker_backend='nccl': worker {slot} needs GPU {first + slot} "
                         f"(after the learner's {first}) but this node has {n_gpus}; use "
                         "deploy.sync.worker_backend=gloo or fewer deploy.engines")
    return (first + slot) % n_gpus


def spawned_worker_env(servers_attached: bool) -> dict[str, str]:
    """What the controller adds to the environment of the workers it spawns. A local engine
    worker picks its GPU itself (`worker_gpu`, among the learner's). An SGLang worker attached to
    servers (sglang.urls) forwards weights from host memory and gets no GPU
    (CUDA_VISIBLE_DEVICES=''): left with the learner's, it took cuda:0 (learner rank 0's) for
    an NCCL rank of its server's group; without one, that group runs over gloo. A worker that
    launches its own server keeps the GPUs: that server needs them. servers_attached: the
    engines' `EngineKind.servers_attached` (qurl/engines/kind.py; asked by the caller, since
    this room sits below the engines)."""
    if servers_attached:
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {}


def sglang_base_gpus(learner: LearnerConfig, ranks: RanksDeployConfig, sglang: SGLangConfig,
                     count: int, n_gpus: int, *, slot: int | None = None) -> list[int] | None:
    """The first GPU (`--base-gpu-id`) of each SGLang server qurl launches on a learner node:
    `count` servers of the sync loop (slot None), or async worker `slot`'s one server; each holds
    sglang.tp GPUs after the learner's ranks (module docstring). None on a machine without GPUs
    (n_gpus 0: no placement). ConfigError when the node has too few GPUs."""
    if n_gpus <= 0:
        return None
    first, tp = learner_ranks_per_node(learner, ranks), sglang.tp
    index = range(count) if slot is None else [slot]
    bases = [first + i * tp for i in index]
    need = bases[-1] + tp if bases else first
    if need > n_gpus:
        who = (f"deploy.engines={count} SGLang servers" if slot is None
               else f"the SGLang server of async worker {slot}")
        raise ConfigError(f"{who} with sglang.tp={tp} need GPUs {first}..{need - 1} after the "
                          f"learner's {first} rank(s) on this node, which has {n_gpus}; use fewer "
                          "deploy.engines, a smaller sglang.tp, or attach servers elsewhere "
                          "(sglang.urls)")
    return bases
