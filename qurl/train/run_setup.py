"""Opening a run on a learner rank: for the training loop of every mode (loop.py,
`open_run`), and for the commands that read a finished run's checkpoint (`qurl eval`,
`qurl export`: `on_checkpoint`).

For training, on every learner rank: pin CPU threads, join the process groups, make or find the base model
(rank 0), build the Megatron learner (UAQ applied to its master weights) and, on resume, load the
newest intact checkpoint (qurl/checkpoint/rundir.py). `save_checkpoint` is the matching writer. Rank 0 also checks that a resume does not change an immutable field, that a fresh
run does not overwrite an existing one, and writes the resolved config into the run directory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from qurl.checkpoint.checksums import save_torch
from qurl.checkpoint.rundir import (CheckpointDir, check_resume_config, read_config, run_dir_for,
                                    write_config)
from qurl.config import Config, ConfigError, to_toml
from qurl.errors import CheckpointError
from qurl.learner.dist import broadcast_object, gather_object, init_learner_dist, is_main_rank
from qurl.learner.megatron import MegatronLearner
from qurl.models.base import base_dir, prepare_base_model
from qurl.node.placement import learner_threads, set_threads


T = TypeVar("T")


@dataclass
class OpenedRun:
    run_dir: Path
    ckpts: CheckpointDir
    model_dir: str
    learner: MegatronLearner
    start: int  # last completed step (0 for a fresh run)
    state: dict[str, Any] | None  # rank 0's state.pt of the resumed (or read) checkpoint
    main: bool


def open_run(cfg: Config, *, resume: bool, rank: int, world_size: int) -> OpenedRun:
    """Open the run `cfg` describes on this learner rank (module docstring). It takes the whole
    `Config`, as the run's entry: it compares the whole tree with a resumed run's config.toml,
    writes it there, and hands each component its sections (the base model, the learner, the
    threads and process groups)."""
    run_dir = run_dir_for(cfg.deploy, cfg.run)
    ckpts = CheckpointDir(run_dir, keep=cfg.deploy.keep_ckpts)
    set_threads(learner_threads(cfg.learner, cfg.rollout, cfg.deploy))
    init_learner_dist(cfg.learner, rank, world_size, ranks=cfg.deploy.ranks, host=cfg.deploy.host)
    main = is_main_rank()
    found = None
    if main:
        if resume:
            check_resume_config(read_config(run_dir), cfg)
            found = ckpts.latest()  # newest intact checkpoint, before any slow setup
            if found is None:
                raise CheckpointError(f"{run_dir}: nothing to resume (no checkpoint yet)")
        elif (run_dir / "ckpt" / "latest").exists():
            raise ConfigError(f"{run_dir} already holds a run: resume it with --resume {run_dir} "
                              "or pick another run.name")
        write_config(run_dir, to_toml(cfg))
    model_dir = broadcast_object(prepare_base_model(cfg.model, cfg.data, cfg.run.seed, cfg.deploy,
                                                    run_dir) if main else None)
    torch.manual_seed(cfg.run.seed)
    learner = MegatronLearner(model_dir, cfg.model, cfg.algo, cfg.optim, cfg.learner,
                              total_steps=cfg.run.steps, seed=cfg.run.seed, ranks=cfg.deploy.ranks,
                              norm_len=cfg.rollout.max_new_tokens)
    start, state = 0, None
    if resume:
        latest = broadcast_object(str(found) if main else None)
        learner.load(Path(latest))
        state = torch.load(Path(latest) / "state.pt", weights_only=False)
        start = state["step"]
    return OpenedRun(run_dir, ckpts, model_dir, learner, start, state, main)


def on_checkpoint(cfg: Config, ckpt: str | None, job: Callable[..., T], *, rank: int,
                  world_size: int, **kwargs: Any) -> T:
    """One learner rank of a command that reads checkpoint `ckpt` of the run `cfg` describes
    (`qurl eval`, `qurl export`; the rank entry `qurl.commands.ranks.run_ranks` starts): open it
    as `--resume` would (threads, with no rollout workers beside the learner; process groups; the
    base model the run started from, in its layer spec; the checkpoint's weights loaded; rank 0
    also its state.pt) and return job(opened, **kwargs). `ckpt` None: the base checkpoint itself,
    as a run's step 0. Nothing is written. It takes the whole `Config`, as `open_run` does, and
    hands the learner its sections; the job receives only what its caller passes it."""
    set_threads(learner_threads(cfg.learner, cfg.rollout, cfg.deploy, workers=False))
    init_learner_dist(cfg.learner, rank, world_size, ranks=cfg.deploy.ranks, host=cfg.deploy.host)
    run_dir = run_dir_for(cfg.deploy, cfg.run)
    model_dir = str(base_dir(cfg.model, run_dir))
    learner = MegatronLearner(model_dir, cfg.model, cfg.algo, cfg.optim, cfg.learner,
                              total_steps=cfg.run.steps, seed=cfg.run.seed, ranks=cfg.deploy.ranks)
    main, start, state = is_main_rank(), 0, None
    if ckpt is not None:
        learner.load(Path(ckpt))
        start = int(Path(ckpt).name.removeprefix("step_"))
        if main and (Path(ckpt) / "state.pt").is_file():
            state = torch.load(Path(ckpt) / "state.pt", weights_only=False)
    opened = OpenedRun(run_dir, CheckpointDir(run_dir), model_dir, learner, start, state, main)
    return job(opened, **kwargs)


def save_checkpoint(ckpts: CheckpointDir, learner: MegatronLearner, step: int,
                    state: dict[str, Any] | None) -> None:
    """All ranks write their learner shard into one temp dir; rank 0 adds `state` as state.pt and
    commits (manifest of every file's checksum, atomic rename, `latest`)."""
    main = is_main_rank()
    tmp = Path(broadcast_object(str(ckpts.begin(step)) if main else None))
    per_rank = gather_object(learner.save(tmp))  # also a barrier: every shard is on disk
    if main:
        sums = {name: s for rank_sums in per_rank for name, s in rank_sums.items()}
        sums["state.pt"] = save_torch(state, tmp / "state.pt")
        ckpts.commit(tmp, sums)
