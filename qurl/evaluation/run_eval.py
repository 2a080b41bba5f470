"""`qurl eval`: the paper's evaluation of a run's latest checkpoint, or `--step N`'s (suite.py).

The checkpoint's learner weights (UAQ-scaled master weights) are loaded into a learner, quantized to
the run's rollout precision and loaded into a fresh engine — the same path a training step takes —
so the `eval/...` numbers are what the 8-bit actor of that checkpoint scores; with eval.fp_policy the
same master weights, unquantized, are scored beside it (`eval_fp/...`, `eval_gap/...`). What is
measured (sets, greedy, Avg@k, pass@k) is the run's config, which `--set eval.samples=32` etc. may
change for this call.
"""
from __future__ import annotations

from pathlib import Path

import torch

from qurl.checkpoint.rundir import CheckpointDir, read_config, run_dir_for
from qurl.config import Config, ConfigError, override, parse_sets, validate
from qurl.deploy.ranks import run_ranks
from qurl.engines.factory import engine_wire_dtype, make_engine
from qurl.evaluation.suite import Evaluator
from qurl.learner.dist import init_learner_dist, is_main_rank
from qurl.learner.megatron import MegatronLearner
from qurl.models.base import builds_base
from qurl.models.registry import resolve_base
from qurl.node.placement import learner_threads, set_threads
from qurl.sync.publish import WeightSync


def _eval_entry(cfg: Config, *, ckpt: str, max_examples: int | None, per_question: bool,
                answers: bool, rank: int, world_size: int) -> dict:
    set_threads(learner_threads(cfg, workers=False))
    init_learner_dist(cfg.learner, rank, world_size, deploy=cfg.deploy)
    model_dir = str(run_dir_for(cfg) / "base_model") if builds_base(cfg) \
        else resolve_base(cfg.model.base)
    learner = MegatronLearner(model_dir, cfg.model, cfg.algo, cfg.optim, cfg.learner,
                              total_steps=cfg.run.steps, seed=cfg.run.seed, deploy=cfg.deploy)
    learner.load(Path(ckpt))
    main = is_main_rank()
    engine = make_engine(cfg, model_dir) if main else None
    try:
        WeightSync(cfg.rollout.precision, wire_dtype=engine_wire_dtype(cfg, model_dir)).push(
            learner.named_weights(), engine, version=0)  # the version the record states is below
        step = version = int(Path(ckpt).name.removeprefix("step_"))
        state = Path(ckpt) / "state.pt"
        if main and state.is_file():  # the policy version trained into these weights
            version = int(torch.load(state, weights_only=False).get("version", step))
        evaluator = Evaluator(cfg, model_dir, main=main, max_examples=max_examples,
                              per_question=per_question, answers=answers)
        return evaluator.run(step, version, engine, learner) or {}
    finally:
        if engine is not None:  # SGLang servers launched for this evaluation stop with it
            engine.close()


def eval_run(run_dir: Path, max_examples: int | None = None, sets: list[str] | None = None,
             per_question: bool = False, step: int | None = None, answers: bool = False) -> dict:
    """Evaluate `run_dir`'s latest checkpoint, or that of `step`; `sets`: `--set` overrides (e.g.
    eval.samples=8); per_question: also the right answers per question (`eval_counts`); answers:
    also the greedy answers' text (`eval_answers`, needs eval.greedy)."""
    cfg = override(read_config(run_dir), {"deploy.dir": str(run_dir.parent), "run.name": run_dir.name})
    cfg = validate(override(cfg, parse_sets(sets or [])))
    if answers and not cfg.eval.greedy:
        raise ConfigError("qurl eval --answers: the answers kept are the greedy ones; "
                          "eval.greedy is false")
    ckpt = CheckpointDir(run_dir).latest() if step is None else CheckpointDir(run_dir).at(step)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to evaluate")
    return run_ranks(_eval_entry, cfg, ckpt=str(ckpt), max_examples=max_examples,
                     per_question=per_question, answers=answers)
