"""Process groups for the learner: torch.distributed (gloo on CPU, NCCL on GPU) + megatron's TP groups.

The learner has learner.tp × learner.dp ranks: megatron puts consecutive ranks in one TP group
(keep a TP group inside a node) and ranks tp apart in one data-parallel group. Rank 0
is the controller: it owns the data, the engine and the run directory, and shares each batch with
`broadcast_object`.

Waiting for rank 0. While rank 0 generates a batch or evaluates (hours for a paper preset's step-0
evaluation), the other ranks wait in `broadcast_object`. Inside an NCCL collective that wait would
meet the process group's timeout (30 min) and NCCL's watchdog would kill the job, so control
messages (`broadcast_object`, `gather_object`) go through a gloo side group whose timeout is
deploy.ranks.wait_timeout_min; tensors (gradients, weights) stay on the default group, entered only once
every rank is there. Launch with torchrun (RANK/WORLD_SIZE/MASTER_* in the environment) or with
`spawn` (tests, the CPU launcher), which picks a free port and sets the same variables.

Invariants: `init_learner_dist` is idempotent within a process; after it returns, megatron's
`parallel_state` reports TP size = learner.tp, DP size = learner.dp and expert-parallel size =
learner.ep (groups of ep data-parallel ranks that divide a mixture of experts' experts:
qurl/learner/expert_parallel.py); `spawn` returns each rank's return value, in rank order, and
raises if any rank failed.
"""
from __future__ import annotations

import datetime
import inspect
import logging
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from megatron_patches.imports import import_megatron_core
from qurl.config import ConfigError, LearnerConfig, RanksDeployConfig
from qurl.errors import InputError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(ranks: RanksDeployConfig) -> str:
    if ranks.backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if ranks.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("deploy.ranks.backend='nccl' needs CUDA; use 'gloo' or 'auto' on CPU")
    return ranks.backend


_WAIT_GROUP: Any = None  # gloo side group of every rank for control messages (module docstring)
_WAIT_MIN = 0.0


def init_learner_dist(learner: LearnerConfig, rank: int, world_size: int, *,
                      ranks: RanksDeployConfig = RanksDeployConfig(), host: str = "127.0.0.1",
                      timeout_min: float = 30.0) -> None:
    """Join the default process group (if not yet; collectives time out after `timeout_min`), the
    gloo control group (waits time out after deploy.ranks.wait_timeout_min) and build megatron's TP,
    DP and expert (EP, expert-DP) groups."""
    global _WAIT_GROUP, _WAIT_MIN
    if world_size != learner.tp * learner.dp:
        raise ConfigError(f"learner.tp={learner.tp} x learner.dp={learner.dp}: needs world_size "
                         f"{learner.tp * learner.dp}, got {world_size}")
    if learner.dp % learner.ep:
        raise ConfigError(f"learner.ep={learner.ep}: must divide learner.dp={learner.dp}")
    backend = resolve_backend(ranks)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if not dist.is_initialized():
        addr = os.environ.get("MASTER_ADDR", host)
        port = os.environ.get("MASTER_PORT", str(ranks.port))
        pick_interface(addr)
        _WAIT_GROUP = None  # one of an earlier default group, destroyed with it
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(minutes=timeout_min))
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"torch.distributed already initialized as rank {dist.get_rank()} of "
                         f"{dist.get_world_size()}, asked for {rank} of {world_size}")
    if _WAIT_GROUP is None and world_size > 1:  # every rank, before megatron's groups
        _WAIT_MIN = ranks.wait_timeout_min
        _WAIT_GROUP = dist.new_group(backend="gloo",
                                     timeout=datetime.timedelta(minutes=_WAIT_MIN))
    import_megatron_core()  # before any megatron import in this process (quiet and fast)
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != (learner.tp, learner.ep):
            raise ValueError(f"megatron parallel_state already set up with (TP, EP)={have}, asked "
                             f"for {(learner.tp, learner.ep)}")
        return
    # EP groups: ep consecutive DP replicas (megatron's default order "tp-cp-ep-dp-pp"); each
    # such group holds every expert once (qurl/learner/expert_parallel.py)
    kwargs: dict[str, Any] = {"tensor_model_parallel_size": learner.tp,
                              "expert_model_parallel_size": learner.ep}
    # Extra gloo groups only serve megatron's own distributed optimizer, which the learner does not
    # use (distopt.py shards over the main DP group).
    if "create_gloo_process_groups" in inspect.signature(ps.initialize_model_parallel).parameters:
        kwargs["create_gloo_process_groups"] = False
    ps.initialize_model_parallel(**kwargs)


def pick_interface(master: str) -> str | None:
    """Set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (those not set already) to the interface this
    node reaches `master` through (qurl/node/netif.py), so a torchrun started by hand across nodes
    works as `qurl launch`'s commands do. Nothing for a loopback master (one machine) or when no
    interface is found (the libraries' own choice then stands). Returns the name set, if any."""
    from qurl.node.netif import IFNAME_VARS, interface_to

    if master in ("127.0.0.1", "localhost", "::1") or all(os.environ.get(k) for k in IFNAME_VARS):
        return None
    try:
        name = interface_to(master)
    except ValueError:
        return None
    for k in IFNAME_VARS:
        os.environ.setdefault(k, name)
    return name


def destroy_learner_dist() -> None:
    from megatron.core import parallel_state as ps

    global _WAIT_GROUP
    _WAIT_GROUP = None
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class _Waiting:
    """Turns a timed-out wait on the control group into one line naming the config field."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, err: BaseException | None, tb: Any) -> bool:
        if _WAIT_GROUP is not None and isinstance(err, RuntimeError) \
                and "timed out" in str(err).lower():
            raise RuntimeError(
                f"learner rank {dist.get_rank()}: waited deploy.ranks.wait_timeout_min={_WAIT_MIN:g} "
                f"minutes for the other ranks (rank 0 generating or evaluating?): "
                f"{str(err).splitlines()[0]}") from err
        return False


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (pickled; tensors come back on CPU). A barrier as well,
    through the control group: the others wait up to deploy.ranks.wait_timeout_min for rank `src`."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    with _Waiting():
        dist.broadcast_object_list(box, src=src, group=_WAIT_GROUP)
    return box[0]


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank `dst` (None elsewhere). A collective: every rank
    calls it, and rank `dst` returns only after all ranks have (control group, like broadcast)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    with _Waiting():
        dist.gather_object(obj, out, dst=dst, group=_WAIT_GROUP)
    return out


def _spawn_entry(rank: int, world_size: int, port: int, out_dir: str, env: dict[str, str],
                 fn: Callable, args: tuple) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from its start
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)  # ranks share few cores; oversubscription only slows them down
    try:
        result = fn(rank, world_size, *args)
    except InputError as e:  # handed to the parent as itself, not as a traceback
        torch.save(e, Path(out_dir) / f"error{rank}.pt")
        sys.exit(2)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def _rank_server() -> str:
    """The start method of learner ranks: "forkserver", its server preloading
    qurl/learner/preload.py (set once, before the server's first start)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["qurl.learner.preload"])
    return "forkserver"


def spawn(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` new processes with MASTER_ADDR/PORT set
    to a free local port; return the ranks' return values in rank order. The processes are forks
    of a server that has imported torch, megatron-core and transformers once (qurl/learner/
    preload.py; the forkserver start method), each given the caller's environment and, as with
    the spawn method, its working directory and import path.
    `fn` and `args` must be picklable (module-level function). A failing rank raises here: an
    InputError (bad config, data or run dir) as that error, from the lowest rank that raised one."""
    # torch logs "Terminating process ..." for the ranks it stops after one failed: noise next to
    # the failing rank's own error
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="qurl-spawn-") as out:
        try:
            mp.start_processes(_spawn_entry, nprocs=world_size, join=True,
                               args=(world_size, free_port(), out, dict(os.environ), fn, args),
                               start_method=_rank_server())
        except ProcessException:
            raised = sorted(Path(out).glob("error*.pt"), key=lambda p: int(p.stem[5:]))
            if raised:
                raise torch.load(raised[0], weights_only=False) from None
            raise
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
