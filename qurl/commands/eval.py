"""`qurl eval`: the paper's evaluation of a run's latest checkpoint, or `--step N`'s
(qurl/train/eval_suite.py), or of an HF checkpoint directory (an export from `qurl export`, a base
model) under a run's config.

    qurl eval runs/<run> [--step N] [--set eval.samples=32] [-n N] [--per-question] [--answers]
    qurl eval DIR --config runs/<run>/config.toml   an HF checkpoint directory (an export)

The record's `eval/...` keys are printed one a line after its summary; `--out` also writes it
(JSON). A run directory is evaluated under its own config.toml (`--preset` / `--config` are
refused there); a checkpoint directory under `--config` / `--preset` (default cpu-tiny), without
`--step`.

The checkpoint's learner weights (UAQ-scaled master weights) are loaded into a learner, quantized to
the run's rollout precision and loaded into a fresh engine — the same path a training step takes —
so the `eval/...` numbers are what the 8-bit actor of that checkpoint scores; with eval.fp_policy the
same master weights, unquantized, are scored beside it (`eval_fp/...`, `eval_gap/...`). What is
measured (sets, greedy, Avg@k, pass@k) is the run's config, which `--set eval.samples=32` etc. may
change for this call.

An HF checkpoint directory is evaluated as a run's step 0 would be with it as `model.base`: the
config (a run's config.toml, or a preset) says which sets, which rollout precision and which UAQ
scale; the learner reads the checkpoint, applies UAQ as a run does, and the same path as above
quantizes it into the engine. So an HF export of a run, evaluated under that run's config, gives
the engine the run's own 8-bit actor up to fp32 rounding: UAQ undone and re-applied (x * s / s)
moves some weights by one unit in the last place, and an 8-bit greedy evaluation can answer
differently at that level (docs/models.md measures by how much on SmolLM2-135M).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from qurl.checkpoint.rundir import CheckpointDir, read_config
from qurl.config import (Config, ConfigError, DataConfig, DeployConfig, EvalConfig, RolloutConfig,
                         SGLangConfig, load_config, override, parse_sets, validate)
from qurl.commands.ranks import run_ranks
from qurl.engines.factory import ServerSite, engine_wire_dtype, make_engine
from qurl.errors import InputError
from qurl.train.eval_suite import Evaluator, summary
from qurl.train.run_setup import OpenedRun, on_checkpoint
from qurl.weights.publish import WeightSync
from qurl.weights.settings import SyncSettings


def _evaluate(opened: OpenedRun, *, rollout: RolloutConfig, sglang: SGLangConfig,
              deploy: DeployConfig, ecfg: EvalConfig, data: DataConfig, seed: int,
              site: ServerSite, max_examples: int | None, per_question: bool,
              answers: bool) -> dict:
    """A learner rank's part of `qurl eval` on the opened checkpoint (`on_checkpoint`): rank 0
    starts a fresh engine, the checkpoint's weights are quantized into it as a training step's
    sync does, and the run's evaluation scores them (module docstring). The record on rank 0."""
    engine = make_engine(rollout, sglang, SyncSettings.of(deploy.sync), opened.model_dir,
                         seed=seed, site=site) if opened.main else None
    try:
        wire = engine_wire_dtype(rollout, sglang, opened.model_dir)
        WeightSync(rollout.precision, wire_dtype=wire).push(
            opened.learner.named_weights(), engine, version=0)  # the version the record states is below
        # the policy version trained into these weights (rank 0 read the checkpoint's state.pt)
        version = int((opened.state or {}).get("version", opened.start))
        evaluator = Evaluator(ecfg, data, rollout, deploy, opened.model_dir, seed=seed,
                              main=opened.main, max_examples=max_examples,
                              per_question=per_question, answers=answers)
        return evaluator.run(opened.start, version, engine, opened.learner) or {}
    finally:
        if engine is not None:  # SGLang servers launched for this evaluation stop with it
            engine.close()


def _evaluate_under(cfg: Config, ckpt: Path | None, *, max_examples: int | None,
                    per_question: bool, answers: bool) -> dict:
    """Evaluate checkpoint `ckpt` of the run `cfg` describes (None: its base checkpoint) on the
    run's learner ranks; rank 0's record."""
    return run_ranks(on_checkpoint, cfg.learner, cfg, None if ckpt is None else str(ckpt),
                     _evaluate, rollout=cfg.rollout, sglang=cfg.sglang, deploy=cfg.deploy,
                     ecfg=cfg.eval, data=cfg.data, seed=cfg.run.seed,
                     site=ServerSite.of(cfg.deploy, cfg.run, cfg.algo, cfg.learner),
                     max_examples=max_examples, per_question=per_question, answers=answers)


def _check_answers(ecfg: EvalConfig, answers: bool) -> None:
    if answers and not ecfg.greedy:
        raise ConfigError("qurl eval --answers: the answers kept are the greedy ones; "
                          "eval.greedy is false")


def eval_run(run_dir: Path, max_examples: int | None = None, sets: list[str] | None = None,
             per_question: bool = False, step: int | None = None, answers: bool = False) -> dict:
    """Evaluate `run_dir`'s latest checkpoint, or that of `step`; `sets`: `--set` overrides (e.g.
    eval.samples=8); per_question: also the right answers per question (`eval_counts`); answers:
    also the greedy answers' text (`eval_answers`, needs eval.greedy)."""
    cfg = override(read_config(run_dir), {"deploy.dir": str(run_dir.parent), "run.name": run_dir.name})
    cfg = validate(override(cfg, parse_sets(sets or [])))
    _check_answers(cfg.eval, answers)
    ckpt = CheckpointDir(run_dir).latest() if step is None else CheckpointDir(run_dir).at(step)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to evaluate")
    return _evaluate_under(cfg, ckpt, max_examples=max_examples, per_question=per_question,
                           answers=answers)


def eval_checkpoint(model_dir: Path, cfg: Config, max_examples: int | None = None,
                    per_question: bool = False, answers: bool = False) -> dict:
    """Evaluate the HF checkpoint `model_dir` under `cfg` (module docstring): its step-0 record.
    InputError (one line) for a directory that is not a checkpoint qurl trains, or an 8-bit export
    (its codes are the engine's, not a policy a learner can read: evaluate its run instead)."""
    from qurl.models.fits import check_fits

    meta = model_dir / "config.json"
    if meta.is_file() and "quantization_config" in json.loads(meta.read_text()):
        raise InputError(f"{model_dir}: an 8-bit export (quantization_config in config.json); "
                         "qurl eval reads full-precision checkpoints: export with --format hf, "
                         "or evaluate the run it came from")
    cfg = validate(override(cfg, {"model.base": str(model_dir), "model.warmstart_steps": 0,
                                  "run.name": f"eval-{model_dir.name}"}))
    _check_answers(cfg.eval, answers)
    check_fits(str(model_dir), learner_tp=cfg.learner.tp, engine=cfg.rollout.engine,
               precision=cfg.rollout.precision, sglang_tp=cfg.sglang.tp, learner_ep=cfg.learner.ep)
    return _evaluate_under(cfg, None, max_examples=max_examples, per_question=per_question,
                           answers=answers)


def run(args: argparse.Namespace) -> int:
    """`qurl eval` with its parsed arguments (module docstring); the exit code."""
    path = Path(args.path)
    checkpoint = (path / "config.json").is_file() and not (path / "config.toml").is_file()
    if not checkpoint:  # a run directory (eval_run's errors name what is missing)
        if args.preset or args.config:
            raise InputError(f"{path} is a run directory: its own config.toml is used "
                             "(--preset / --config are for an HF checkpoint directory)")
        rec = eval_run(path, max_examples=args.n, sets=args.set, per_question=args.per_question,
                       step=args.step, answers=args.answers)
    else:
        if args.step is not None:
            raise InputError(f"--step: {path} is a checkpoint directory, not a run")
        cfg = load_config(args.preset or "cpu-tiny", args.config, args.set)
        rec = eval_checkpoint(path, cfg, max_examples=args.n, per_question=args.per_question,
                              answers=args.answers)
    if args.out:
        Path(args.out).write_text(json.dumps(rec) + "\n")
    print(f"{args.path}: {summary(rec)}")
    for key in sorted(k for k in rec if k.startswith(("eval/", "eval_fp/", "eval_gap/"))):
        print(f"  {key:40s} {rec[key]:.4f}")
    return 0
