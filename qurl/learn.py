"""The learner loop: QuRL's synchronous RLVR step, one version per step.

    UAQ once (inside the learner, on the master weights); sync v0 to the 8-bit engine
    for step in 1..N:
        prompts   <- data cursor
        groups    <- rollout with the 8-bit engine (behav_logp, version per token) + verifiable reward
                     (DAPO dynamic sampling: more prompts until B groups of mixed accuracy)
        batch     <- group advantages (GRPO / Dr.GRPO), padded
        train     <- prox_logp recomputed once; ≥2 mini-batches of the decoupled/ACR surrogate
        version  += 1; re-quantize master weights -> engine (flip fraction measured)
        log, evaluate (qurl/evaluation/: 8-bit engine and fp policy), checkpoint (atomic)

Every TP rank runs this loop; rank 0 alone owns the engine, the data and the run directory and
broadcasts each batch to the other ranks. The async pipeline (qurl/pipeline/) replaces the rollout
line with a staleness-bounded stream of trajectories; η=0 reduces it to this loop.
"""
from __future__ import annotations

import time
from dataclasses import asdict

import torch

from qurl.batching import build_batch
from qurl.config import Config
from qurl.data.cursor import DataCursor
from qurl.dynamic_sampling import sample_groups
from qurl.evaluation.suite import Evaluator, summary
from qurl.learner.dist import broadcast_object
from qurl.metrics import MetricsLogger
from qurl.rollout import PromptCodec
from qurl.runs import rng_state, set_rng_state
from qurl.setup import engine_wire_dtype, load_datasets, make_engine
from qurl.start import open_run, save_checkpoint
from qurl.types import SamplingParams
from qurl.weights import WeightSync


def _train_record(step: int, version: int, rstats: dict, bstats: dict, tstats: dict, sstats: dict,
                  t_train: float, batch_tokens: int) -> dict:
    rec = {"kind": "train", "step": step, "version": version}
    rec.update(rstats)
    rec.update(bstats)
    rec.update(tstats)
    rec.update(sstats)
    rec["time/train"] = t_train
    rec["train_tokens_per_s"] = batch_tokens / max(t_train, 1e-9)
    rec["threads/learner"] = float(torch.get_num_threads())  # generation runs on the same ones
    return rec


def train(cfg: Config, *, resume: bool = False, rank: int = 0, world_size: int = 1) -> dict:
    """Run (or resume) the synchronous loop. Returns the final eval record on rank 0."""
    run = open_run(cfg, resume=resume, rank=rank, world_size=world_size)
    run_dir, ckpts, learner, start, state, main = (run.run_dir, run.ckpts, run.learner, run.start,
                                                   run.state, run.main)
    model_dir = run.model_dir

    engine = logger = cursor = codec = None
    train_set = []
    if main:
        train_set, _ = load_datasets(cfg)
        cursor = DataCursor(len(train_set), seed=cfg.run.seed)
        engine = make_engine(cfg, model_dir)
        codec = PromptCodec(engine.tokenizer, cfg.data.template)
        logger = MetricsLogger(run_dir, total_steps=cfg.run.steps, start_step=start,
                               wandb=cfg.run.wandb, wandb_mode=cfg.run.wandb_mode,
                               run_name=cfg.run.name, config=asdict(cfg), progress=cfg.run.progress)
        if state is not None:
            cursor.load_state_dict(state["cursor"])
            set_rng_state(state["rng"])
    sync = WeightSync(cfg.rollout.precision, int(cfg.sync.bucket_mb * (1 << 20)),
                      engine_wire_dtype(cfg, model_dir))
    version = start
    sync.push(learner.named_weights(), engine, version)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            stop_token_ids=(engine.tokenizer.eos_token_id,) if main else ())

    evaluator = Evaluator(cfg, model_dir, main=main)

    def run_eval(step: int) -> dict | None:
        rec = evaluator.run(step, version, engine, learner)  # every rank: fp policy's weights
        if main:
            logger.log(rec)
            logger.write(summary(rec))
        return rec

    last_eval = run_eval(0) if start == 0 else None
    for step in range(start + 1, cfg.run.steps + 1):
        if main:
            groups, rstats = sample_groups(engine, train_set, cursor, codec, params, cfg, step=step)
            batch, bstats = build_batch(
                groups, version=version, pad_id=engine.tokenizer.pad_token_id,
                advantage=cfg.algo.advantage, dynamic_sampling=cfg.algo.dynamic_sampling,
                overlong_buffer=cfg.algo.overlong_buffer,
                overlong_penalty_value=cfg.algo.overlong_penalty,
                max_new_tokens=cfg.rollout.max_new_tokens)
        batch = broadcast_object(batch if main else None)
        t0 = time.perf_counter()
        tstats = {} if batch is None else learner.train_step(
            batch.tokens, batch.loss_mask, batch.behav_logp, batch.adv, staleness=batch.staleness,
            temperature=cfg.rollout.temperature)
        t_train = time.perf_counter() - t0
        version += 1
        sstats = sync.push(learner.named_weights(), engine, version)
        if main:
            logger.log(_train_record(step, version, rstats, bstats, tstats, sstats, t_train,
                                     batch.num_tokens if batch is not None else 0))
        if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step != cfg.run.steps:
            last_eval = run_eval(step)
        if step == cfg.run.steps or (cfg.run.ckpt_every and step % cfg.run.ckpt_every == 0):
            save_checkpoint(ckpts, learner, step, {
                "step": step, "version": version, "rng": rng_state(),
                "cursor": cursor.state_dict() if main else None})
    if start < cfg.run.steps or last_eval is None:
        last_eval = run_eval(cfg.run.steps)
    if main:
        logger.close()
    return last_eval or {}
