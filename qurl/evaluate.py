"""`qurl eval`: greedy held-out accuracy of a run's latest checkpoint, through the configured engine.

The checkpoint's learner weights (UAQ-scaled master weights) are loaded into a learner, quantized to
the run's rollout precision and loaded into a fresh engine — the same path a training step takes —
so the number is what the 8-bit actor of that checkpoint scores.
"""
from __future__ import annotations

from pathlib import Path

from qurl.config import Config, override
from qurl.data.splits import load_datasets
from qurl.engines.factory import engine_wire_dtype, make_engine
from qurl.learner.dist import init_learner_dist, is_main_rank
from qurl.learner.megatron import MegatronLearner
from qurl.ranks import launch
from qurl.rollout import PromptCodec, evaluate
from qurl.runs import CheckpointDir, read_config, run_dir_for
from qurl.setup import busy_processes, set_threads
from qurl.weights import WeightSync


def _eval_entry(cfg: Config, *, ckpt: str, max_examples: int | None, rank: int,
                world_size: int) -> dict:
    set_threads(cfg, busy_processes(cfg, world_size, workers=False))
    init_learner_dist(cfg.learner, rank, world_size)
    model_dir = str(run_dir_for(cfg) / "base_model") if cfg.model.preset != "path" else cfg.model.path
    learner = MegatronLearner(model_dir, cfg.model, cfg.algo, cfg.optim, cfg.learner,
                              total_steps=cfg.run.steps, seed=cfg.run.seed)
    learner.load(Path(ckpt))
    engine = make_engine(cfg, model_dir) if is_main_rank() else None
    WeightSync(cfg.rollout.precision, wire_dtype=engine_wire_dtype(cfg, model_dir)).push(
        learner.named_weights(), engine, version=0)
    if not is_main_rank():
        return {}
    _, eval_set = load_datasets(cfg)
    eval_set = eval_set[:max_examples] if max_examples else eval_set
    return evaluate(engine, eval_set, PromptCodec(engine.tokenizer, cfg.data.template),
                    max_new_tokens=cfg.rollout.eval_max_new_tokens,
                    reward_timeout_s=cfg.data.reward_timeout_s)


def eval_run(run_dir: Path, max_examples: int | None = None) -> dict:
    cfg = override(read_config(run_dir), {"run.dir": str(run_dir.parent), "run.name": run_dir.name})
    latest = CheckpointDir(run_dir).latest()
    if latest is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to evaluate")
    return launch(_eval_entry, cfg, ckpt=str(latest), max_examples=max_examples)
