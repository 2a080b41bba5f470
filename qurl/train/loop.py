"""The training loop of every mode: ask a batch source for groups, train, hand it the new weights.

    open the run (run_setup.py); rank 0 loads the data and builds the sync loop's engine
    and the batch source
    source.publish(v0)                      the UAQ-scaled master weights, quantized, to the actor
    evaluate at step 0 (fresh run)
    for step in start+1 .. run.steps:
        groups <- source.next_groups(step)  rank 0: B prompts x G scored samples
        batch  <- build_batch(groups)       rank 0; broadcast to every TP rank
        train  <- learner.train_step(batch) every rank (prox_logp once, ≥2 mini-batches)
        version += 1; source.publish(new weights)   the gather is a collective of every rank
        log the train record; evaluate / checkpoint as configured
    evaluate at the end

A batch source is where rollouts come from. `InProcessRollout` (inline.py) generates each batch
with an engine in this process at the current version: the synchronous loop. The async `Controller`
(qurl/pipeline/controller.py) dispatches prompts to rollout workers under the staleness bound η and
pops B complete groups from its buffer; its weights go to the workers through the weight group.
With η = 0 it dispatches exactly the sync loop's prompts at the current version, with the same
request seeds (requests.py `make_requests`), and everything after `next_groups` is this one loop, so
η = 0 reproduces the sync loop by construction. The other TP ranks run the same loop with no source:
they receive the batch, train, take part in the weight gather and write their checkpoint shard.

This module alone decides the record shapes and metric names (train: rollout statistics of the
trained batch, the source's timings and statistics (with sync DAPO dynamic sampling: those of every
sampled response, dynamic_sampling.py), batch, learner and sync statistics; eval: the record of
eval_suite.py, rollout engine and full-precision policy side by side), the eval /
checkpoint cadence and the checkpoint state: step, version, RNG, the mismatch alarm's history
(alarm.py: its `alarm/*` keys join the train record; with deploy.alarm.stop it ends the
run before that step's checkpoint) and the source's own state (the data cursor; for async also the
buffer, staleness counters and ledger).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from qurl.checkpoint.rundir import rng_state, set_rng_state
from qurl.config import AlarmDeployConfig, Config, ConfigError
from qurl.data.datasets import Example
from qurl.data.splits import load_datasets
from qurl.types import Engine
from qurl.engines.factory import ServerSite, make_engine
from qurl.errors import RunHalted
from qurl.train.eval_suite import Evaluator, Generator, summary
from qurl.learner.dist import broadcast_object
from qurl.models.hf import load_tokenizer, vocab_size
from qurl.train.batch import build_batch
from qurl.train.generate import group_stats
from qurl.train.requests import PromptCodec
from qurl.train.alarm import MismatchAlarm
from qurl.train.metrics_log import MetricsLogger
from qurl.train.run_setup import OpenedRun, open_run, save_checkpoint
from qurl.types import SamplingParams, Trajectory
from qurl.weights.settings import SyncSettings


@dataclass
class RankZero:
    """What rank 0 runs on: the opened run, its data, an engine (the sync loop's; None for the
    async controller, whose workers generate and evaluate), the model's tokenizer (it pads the
    batches) and vocabulary size, and the sampling parameters."""

    cfg: Config
    run: OpenedRun
    train_set: list[Example]
    engine: Engine | None
    tokenizer: Any
    vocab_size: int
    codec: PromptCodec
    params: SamplingParams  # rollout sampling (temperature, top_p, length, stop at EOS)


class BatchSource(Protocol):
    """Rank 0's supplier of training groups and consumer of new weights."""

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Quantize the learner's weights of `version` and deliver them to the actor. `named` is a
        collective (the other ranks drain theirs); returns sync statistics for the train record."""

    def next_groups(self, step: int,
                    version: int) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """B complete groups to train at `version` (step = version + 1 of the sync loop), with the
        source's timing statistics."""

    def step_stats(self, step: int) -> dict[str, float]:
        """Statistics known once the step's weights are published (logged with its train record)."""

    def eval_engine(self, version: int) -> Generator:
        """What answers the evaluation of the actor of `version` (the 8-bit weights the rollouts
        use): the sync loop's engine, or the async workers (qurl/pipeline/remote_eval.py)."""

    def clock(self) -> dict[str, float]:
        """Extra fields stamped on every record (async: the run's wall clock)."""

    def state_dict(self) -> dict[str, Any]:
        """The source's part of the checkpoint (it restores from it when built)."""

    def close(self) -> None: ...


SourceFactory = Callable[[RankZero], BatchSource]


def _drain(named: Iterable[Any]) -> dict[str, float]:
    """A follower rank's part of the weight gather (the collective has no result here)."""
    for _ in named:
        pass
    return {}


def mismatch_alarm(alarm_cfg: AlarmDeployConfig, state: dict | None) -> MismatchAlarm | None:
    """Rank 0's mismatch alarm (alarm.py) from `[deploy.alarm]`, with the history a
    resumed run's checkpoint kept; None when deploy.alarm.kl_factor = 0."""
    if alarm_cfg.kl_factor == 0:
        return None
    if alarm_cfg.kl_factor <= 1:
        raise ConfigError(f"deploy.alarm.kl_factor={alarm_cfg.kl_factor}: must be 0 (off) or > 1")
    alarm = MismatchAlarm(alarm_cfg.kl_factor, alarm_cfg.steps)
    if state is not None and "alarm" in state:
        alarm.load_state_dict(state["alarm"])
    return alarm


def train_loop(cfg: Config, make_source: SourceFactory, *, resume: bool, rank: int,
               world_size: int, engine: bool = True) -> dict:
    """Run (or resume) training on this rank with the source `make_source` builds on rank 0.
    engine=False: rank 0 builds no engine, only the tokenizer (the async controller: its workers'
    engines generate the rollouts and the actor's evaluations). Returns the final eval record on
    rank 0, {} elsewhere."""
    run = open_run(cfg, resume=resume, rank=rank, world_size=world_size)
    learner, start, version = run.learner, run.start, run.start
    source: BatchSource | None = None
    evaluator = Evaluator(cfg.eval, cfg.data, cfg.rollout, cfg.deploy, run.model_dir,
                          seed=cfg.run.seed, main=run.main,  # before the source starts workers
                          asynchronous=not engine)
    logger = codec = None
    pad_id = 0
    if run.main:
        train_set, _ = load_datasets(cfg.data, cfg.run.seed)  # the eval sets are the Evaluator's
        eng = make_engine(cfg.rollout, cfg.sglang, SyncSettings.of(cfg.deploy.sync),
                          run.model_dir, seed=cfg.run.seed,
                          site=ServerSite.of(cfg.deploy, cfg.run, cfg.algo, cfg.learner)
                          ) if engine else None
        tok = eng.tokenizer if eng is not None else load_tokenizer(run.model_dir)
        vocab = eng.vocab_size if eng is not None else vocab_size(run.model_dir)
        codec = PromptCodec(tok, cfg.data.template)
        params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                stop_token_ids=(tok.eos_token_id,))
        pad_id = tok.pad_token_id
        source = make_source(RankZero(cfg, run, train_set, eng, tok, vocab, codec, params))
        if run.state is not None:
            set_rng_state(run.state["rng"])

    def publish() -> dict[str, float]:
        named = learner.named_weights()
        return source.publish(named, version) if source is not None else _drain(named)

    def run_eval(step: int) -> dict | None:
        # every rank: scoring the full-precision policy gathers the master weights (a collective)
        engine = source.eval_engine(version) if source is not None else None
        rec = evaluator.run(step, version, engine, learner)
        if source is None:
            return None
        rec.update(source.clock())
        logger.log(rec)
        logger.write(summary(rec))
        return rec

    try:
        if run.main:
            logger = MetricsLogger(run.run_dir, total_steps=cfg.run.steps, start_step=start,
                                   wandb=cfg.deploy.wandb,
                                   run_name=cfg.run.name, config=asdict(cfg),
                                   progress=cfg.deploy.progress)
        alarm = mismatch_alarm(cfg.deploy.alarm, run.state) if run.main else None
        publish()
        last_eval = run_eval(0) if start == 0 else None
        for step in range(start + 1, cfg.run.steps + 1):
            batch = groups = None
            if source is not None:
                groups, gen_stats = source.next_groups(step, version)
                batch, bstats = build_batch(
                    groups, version=version, pad_id=pad_id, advantage=cfg.algo.advantage,
                    dynamic_sampling=cfg.algo.dynamic_sampling_rounds > 0,
                    overlong_buffer=int(cfg.algo.overlong[0]),
                    overlong_penalty_value=cfg.algo.overlong[1],
                    max_new_tokens=cfg.rollout.max_new_tokens)
            batch = broadcast_object(batch)
            t0 = time.perf_counter()
            tstats = {} if batch is None else learner.train_step(
                batch.tokens, batch.loss_mask, batch.behav_logp, batch.adv,
                staleness=batch.staleness, temperature=cfg.rollout.temperature,
                routes=batch.routes)
            t_train = time.perf_counter() - t0
            version += 1
            sstats = publish()
            if source is not None:
                n_tokens = batch.num_tokens if batch is not None else 0
                verdict = None if alarm is None or "kl_behav_prox" not in tstats else \
                    alarm.update(tstats["kl_behav_prox"], step)
                logger.log({"kind": "train", "step": step, "version": version,
                            **group_stats(groups, version - 1), **gen_stats, **bstats, **tstats,
                            **sstats, "time/train": t_train,
                            "train_tokens_per_s": n_tokens / max(t_train, 1e-9),
                            "threads/learner": float(torch.get_num_threads()),
                            **source.step_stats(step), **source.clock(),
                            **(verdict.record if verdict else {})})
                if verdict is not None and verdict.fired:  # once; stop before the checkpoint
                    logger.write(verdict.message)
                    if cfg.deploy.alarm.stop:
                        raise RunHalted(f"{verdict.message} (deploy.alarm.stop)")
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step != cfg.run.steps:
                last_eval = run_eval(step)
            if step == cfg.run.steps or (cfg.deploy.ckpt_every and step % cfg.deploy.ckpt_every == 0):
                state = None if source is None else {
                    "step": step, "version": version, "rng": rng_state(), **source.state_dict(),
                    **({"alarm": alarm.state_dict()} if alarm is not None else {})}
                save_checkpoint(run.ckpts, learner, step, state)
        if start < cfg.run.steps or last_eval is None:
            last_eval = run_eval(cfg.run.steps)
    finally:
        if source is not None:
            source.close()
        if logger is not None:
            logger.close()
    return last_eval or {}
