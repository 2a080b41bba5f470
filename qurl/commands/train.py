"""`qurl train`: start a run, or resume one, from a preset, a TOML config and `--set` overrides.

    qurl train [--preset cpu-tiny] [--config run.toml] [--set section.field=value ...]
    qurl train --resume runs/<run> [--set run.steps=80]

Before any rank starts, what would fail late and far away is refused in one line (exit 2): the
training and eval data are read (a bad row names its file and line), the base model is resolved
(a hub id or a model not fetched), the layout is checked against it (qurl/models/fits.py), and
the learner ranks' memory plan is printed (on a GPU, refused when it cannot hold one row). Then the
learner's ranks start (ranks.py) and each runs the synchronous loop
(qurl/train/inline.py) or the asynchronous controller (qurl/pipeline/controller.py), as
deploy.rollout says; the final evaluation's summary is printed.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from qurl.config import (LOCAL_BASES, Config, DeployConfig, LearnerConfig, ModelConfig,
                         RolloutConfig, load_config, override, parse_sets, validate)
from qurl.errors import InputError


def _config_from_args(args: argparse.Namespace) -> Config:
    """The run's config: a resumed run's own config.toml with `--set` on top, else the preset,
    `--config` and `--set`."""
    if getattr(args, "resume", None):
        from qurl.checkpoint.rundir import read_config

        cfg = read_config(Path(args.resume))
        return validate(override(cfg, parse_sets(args.set or [])))
    return load_config(args.preset, args.config, args.set)


def run(args: argparse.Namespace) -> int:
    """`qurl train` with its parsed arguments (module docstring); the exit code."""
    cfg = _config_from_args(args)
    if args.resume:
        cfg = override(cfg, {"deploy.dir": str(Path(args.resume).parent),
                             "run.name": Path(args.resume).name})
    from qurl.data.splits import load_datasets
    from qurl.commands.ranks import run_ranks
    from qurl.models.registry import resolve_base

    # a bad row fails now, the same on every rank, before any slow setup
    load_datasets(cfg.data, cfg.run.seed)
    from qurl.models.fits import check_fits

    base = cfg.model.base
    if base not in LOCAL_BASES:  # a hub id or a model not fetched: one line, not ranks
        base = resolve_base(base)
    # a model the layout cannot split (TP over its heads, SGLang's block FP8): one line, not ranks
    check_fits(base, learner_tp=cfg.learner.tp, engine=cfg.rollout.engine,
               precision=cfg.rollout.precision, sglang_tp=cfg.sglang.tp,
               routing_replay=cfg.algo.routing_replay, learner_ep=cfg.learner.ep)
    _print_memory_plan(cfg.model, cfg.learner, cfg.rollout, cfg.deploy, kl_coef=cfg.algo.kl_coef)
    result = run_ranks(train, cfg.learner, cfg, resume=bool(args.resume))
    if result:
        from qurl.train.eval_suite import summary

        print(f"final {summary(result)}")
    return 0


def _print_memory_plan(model: ModelConfig, learner: LearnerConfig, rollout: RolloutConfig,
                       deploy: DeployConfig, *, kl_coef: float) -> None:
    """The learner ranks' memory plan (qurl/learner/memory_plan.py, `plan_text`'s sections and
    algo.kl_coef); on a GPU a plan that cannot hold one row is refused here, in one line, before
    any rank starts. On CPU it is printed against each rank's share of the host's memory, and
    only printed (micro-batches there follow the fixed logits budget)."""
    import torch

    from qurl.learner.build import use_transformer_engine
    from qurl.learner.memory_plan import plan_text

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        text, refused = plan_text(model, learner, rollout, deploy, total,
                                  f"GPU {torch.cuda.get_device_name(0)}", kl_coef=kl_coef,
                                  te=use_transformer_engine(deploy.ranks.transformer_engine))
        if refused:
            raise InputError(refused)
    else:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        text, _ = plan_text(model, learner, rollout, deploy, host / (learner.tp * learner.dp),
                            "CPU, each rank's share of the host memory", kl_coef=kl_coef,
                            gpu=False)
    print(text, flush=True)


def train(cfg: Config, *, resume: bool = False, rank: int = 0, world_size: int = 1) -> dict:
    """Run (or resume) the run `cfg` describes on this learner rank: the training loop
    (qurl/train/loop.py) fed by the batch source deploy.rollout names, rollouts generated in this
    process (`inline`, qurl/train/inline.py) or the async controller's workers
    (qurl/pipeline/controller.py). Returns the final eval record on rank 0, {} elsewhere. The
    rank entry of `qurl train`, and `qurl.api.train` in one process. It takes the whole `Config`:
    the loop opens the run (qurl/train/run_setup.py) and hands each component its sections."""
    from qurl.train.loop import train_loop

    if cfg.deploy.rollout == "inline":
        from qurl.train.inline import InProcessRollout

        return train_loop(cfg, InProcessRollout, resume=resume, rank=rank, world_size=world_size)
    from qurl.pipeline.controller import Controller

    # rank 0 builds no engine: the workers generate the rollouts and answer the evaluations
    return train_loop(cfg, Controller, resume=resume, rank=rank, world_size=world_size,
                      engine=False)
