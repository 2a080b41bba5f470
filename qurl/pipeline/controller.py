"""The asynchronous learner loop: learner rank 0 is the controller of a fleet of rollout workers.

    UAQ once (in the learner); quantize v0 -> broadcast to every worker (weight group)
    loop:
        dispatch prompts to workers while (η + version + 1)·B − (accepted + running) > 0
        receive trajectory batches (authenticated, validated); buffer complete groups
        when B complete groups are buffered (the earliest completed, trained in dispatch order):
            batch <- group advantages;  train (≥2 mini-batches, per-token staleness in the stats)
            version += 1; quantize -> broadcast to every worker (they load it between decode steps)
            log, evaluate, checkpoint (atomic, lossless) as configured

Same step, same batch assembly (`build_batch`), same learner call, same request seeds as the
synchronous loop (qurl/learn.py): with η = 0 only B prompts are ever outstanding, all dispatched at
the current version, so each step trains exactly what the sync loop would (up to the float noise of
running the same decoder in another process). With η ≥ 1 generation of the next batches overlaps
training and weight sync; responses may span versions (partial rollout) and the learner sees
per-token staleness.

Nothing is lost or trained twice (qurl/pipeline/dispatch.py, ledger.py): every dataset index taken
from the cursor is in flight at one worker, buffered, trained, or put back. A dead worker's prompts are put back and
re-dispatched; a group that became too stale is dropped and its prompt put back; late output of a
replaced worker is dropped. The checkpoint holds the cursor, the buffer (trajectories received but
not trained), the staleness counters and the ledger; on resume the prompts that were in flight go
back to the cursor. `trained.jsonl` lists the prompt uids of every step (truncated on resume like
metrics.jsonl), so exactly-once can be checked.

The other TP ranks follow the same step sequence (`_follow`): receive the batch, train, take part in
the weight gather, write their checkpoint shard. Re-broadcasts to replaced workers use the chunks
cached on rank 0, so they need no collective. Evaluation uses an engine on rank 0 loaded with the
same cached chunks the workers received (exactly the 8-bit actor they run), and beside it the
full-precision policy (qurl/evaluation/suite.py; its weight gather is the one extra collective).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from qurl.batching import build_batch
from qurl.config import Config
from qurl.evaluation.suite import Evaluator, needs_fp_policy, summary
from qurl.learner.dist import broadcast_object
from qurl.learner.megatron import MegatronLearner
from qurl.metrics import MetricsLogger
from qurl.pipeline.dispatch import Dispatcher
from qurl.pipeline.records import TrainedLog, ack_stats, rollout_stats
from qurl.quant.named import dequantize_named
from qurl.rollout import PromptCodec
from qurl.runs import CheckpointDir, rng_state, set_rng_state
from qurl.setup import engine_wire_dtype, load_datasets, make_engine
from qurl.start import open_run, save_checkpoint
from qurl.sync.arena import ArenaQuantizer
from qurl.types import SamplingParams, Trajectory
from qurl.weights import FlipTracker

log = logging.getLogger("qurl.controller")

STALL_TIMEOUT_S = 900.0  # no trajectory accepted and no step trained for this long: give up
TRAINED_FILE = "trained.jsonl"


def train_async(cfg: Config, *, resume: bool = False, rank: int = 0, world_size: int = 1) -> dict:
    """Run (or resume) the asynchronous loop. Returns the final eval record on rank 0."""
    run = open_run(cfg, resume=resume, rank=rank, world_size=world_size)
    run_dir, ckpts, learner, start, state, main = (run.run_dir, run.ckpts, run.learner, run.start,
                                                   run.state, run.main)
    model_dir = run.model_dir
    if not main:
        return _follow(cfg, learner, ckpts, start)
    ctl = Controller(cfg, learner, run_dir, ckpts, model_dir, start, state)
    try:
        return ctl.run()
    finally:
        ctl.close()


def _drain(it: Any) -> None:
    for _ in it:
        pass


def _follow(cfg: Config, learner: MegatronLearner, ckpts: CheckpointDir, start: int) -> dict:
    """TP ranks > 0: the controller's step sequence, minus everything rank 0 alone owns."""
    fp_eval = needs_fp_policy(cfg)  # each evaluation gathers the master weights once
    _drain(learner.named_weights())
    if fp_eval and start == 0:
        _drain(learner.named_weights())
    for step in range(start + 1, cfg.run.steps + 1):
        batch = broadcast_object(None)
        if batch is not None:
            learner.train_step(batch.tokens, batch.loss_mask, batch.behav_logp, batch.adv,
                               staleness=batch.staleness, temperature=cfg.rollout.temperature)
        _drain(learner.named_weights())
        if fp_eval and cfg.run.eval_every and step % cfg.run.eval_every == 0 \
                and step != cfg.run.steps:
            _drain(learner.named_weights())
        if step == cfg.run.steps or (cfg.run.ckpt_every and step % cfg.run.ckpt_every == 0):
            save_checkpoint(ckpts, learner, step, None)
    if fp_eval:
        _drain(learner.named_weights())
    return {}


class Controller:
    def __init__(self, cfg: Config, learner: MegatronLearner, run_dir: Path, ckpts: CheckpointDir,
                 model_dir: str, start: int, state: dict | None) -> None:
        from qurl.pipeline.fleet import Fleet
        from qurl.pipeline.session import load_or_create_key

        self.cfg, self.learner, self.run_dir, self.ckpts = cfg, learner, Path(run_dir), ckpts
        self.start = self.version = start
        self.B, self.G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
        train_set, _ = load_datasets(cfg)
        # Evaluation only (rollouts are the workers'); local, so it never shares their servers.
        self.engine = make_engine(cfg, model_dir, local=True)
        self.evaluator = Evaluator(cfg, model_dir, main=True)
        self.codec = PromptCodec(self.engine.tokenizer, cfg.data.template)
        params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                stop_token_ids=(self.engine.tokenizer.eos_token_id,))
        self.work = Dispatcher(train_set, batch_size=self.B, group_size=self.G,
                               max_staleness=cfg.rollout.max_staleness,
                               total_steps=cfg.run.steps, seed=cfg.run.seed,
                               encode=self.codec.encode, params=params,
                               dynamic_sampling=cfg.algo.dynamic_sampling)
        self.wall0, self.wall_offset = time.monotonic(), 0.0
        if state is not None:
            self._restore(state)
        self.logger = MetricsLogger(run_dir, total_steps=cfg.run.steps, start_step=start,
                                    wandb=cfg.run.wandb, wandb_mode=cfg.run.wandb_mode,
                                    run_name=cfg.run.name, config=asdict(cfg),
                                    progress=cfg.run.progress)
        self.trained_log = TrainedLog(self.run_dir / TRAINED_FILE, start)
        key = load_or_create_key(self.run_dir, cfg.stream.key)
        self.fleet = Fleet(cfg, self.run_dir, key, model_dir, vocab_size=self.engine.vocab_size,
                           spawn=cfg.rollout.workers == "local",
                           # each local worker gets the learner's share of the node's cores
                           # (qurl.setup.set_threads, called by open_run)
                           worker_threads=torch.get_num_threads())
        self.fleet.inbox.current_version = self.version
        self.chunks: list[tuple[str, torch.Tensor]] = []
        self.flips = FlipTracker()
        # What passes through is sent in the workers' engines' dtype (bf16/fp16 for SGLang); the
        # evaluation engine loads the same chunks, so it scores the actor the workers run.
        self.quantizer = ArenaQuantizer(cfg.rollout.precision, int(cfg.sync.bucket_mb * (1 << 20)),
                                        engine_wire_dtype(cfg, model_dir))
        self._since: Counter[str] = Counter()  # rollout throughput since the last train record
        self._last_progress = time.monotonic()

    # ------------------------------------------------------------------ state

    def _restore(self, state: dict) -> None:
        set_rng_state(state["rng"])
        self.wall_offset = float(state.get("wall", 0.0))
        lost = self.work.load_state_dict(state, self.version)
        log.info("resumed at step %d: %d groups buffered, %d prompts re-dispatched",
                 self.version, self.work.ledger.num_buffered, lost)

    def _state(self, step: int) -> dict:
        """state.pt: step, version, RNG, wall clock, and the dispatcher's cursor, buffer (trajectories
        received but not trained), staleness counters and ledger (prompts in flight)."""
        return {"step": step, "version": self.version, "rng": rng_state(), "wall": self.wall(),
                "mode": "async", **self.work.state_dict()}

    def wall(self) -> float:
        return self.wall_offset + time.monotonic() - self.wall0

    # ------------------------------------------------------------------ weights

    def _quantize(self) -> dict[str, float]:
        """Gather + quantize the current master weights (a collective with the other TP ranks)."""
        self.chunks, gather_s, quant_s = self.quantizer.quantize(self.learner.named_weights())
        stats = {"sync/time_gather": gather_s, "sync/time_quantize": quant_s}
        stats.update(self.flips.update(self.chunks))
        return stats

    def _push(self) -> dict[str, float]:
        t0 = time.perf_counter()
        stats = self.fleet.push(self.chunks, self.version, on_traj=self._accept)
        for k in ("gather", "quantize", "load"):  # quantized here / measured by the workers
            stats.pop(f"sync/time_{k}", None)
        stats["sync/time_push"] = time.perf_counter() - t0
        return stats

    # ------------------------------------------------------------------ dispatch / receive

    def _send(self, slot: int, meta: dict, tensors: dict) -> bool:
        return self.fleet.send_prompt(slot, meta, tensors)

    def _accept(self, msg: Any) -> None:
        """File one trajectory message (channel.py has already authenticated and validated it)."""
        for k in ("gen_s", "new_tokens"):
            if isinstance(msg.meta.get(k), (int, float)):
                self._since[k] += msg.meta[k]
        if self.work.accept(msg.payload, self.version):
            self._last_progress = time.monotonic()

    def _collect(self) -> tuple[list[list[Trajectory]], list, float]:
        """Dispatch and receive until B complete groups can be popped. Returns them in dispatch
        order, their dispatches, and the seconds spent waiting."""
        t0 = time.perf_counter()
        while True:
            self.fleet.check_procs()
            for slot in self.fleet.take_replaced():
                self.work.reclaim(slot)
            if self.fleet.need_group:
                self._push()
                continue
            self.work.dispatch(self.version, self.fleet.ready_slots(), self._send)
            for msg in self.fleet.poll(timeout_ms=20):
                self._accept(msg)
            popped = self.work.pop_batch(self.version)
            if popped is not None:
                return popped[0], popped[1], time.perf_counter() - t0
            if time.monotonic() - self._last_progress > STALL_TIMEOUT_S:
                raise RuntimeError(f"no trajectories for {STALL_TIMEOUT_S:.0f}s; see "
                                   f"{self.run_dir / 'workers'}")

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict:
        cfg = self.cfg
        self.fleet.start()
        self._quantize()
        self._push()
        last_eval = self._eval(0) if self.start == 0 else None
        for step in range(self.start + 1, cfg.run.steps + 1):
            groups, trained, wait_s = self._collect()
            batch, bstats = build_batch(
                groups, version=self.version, pad_id=self.engine.tokenizer.pad_token_id,
                advantage=cfg.algo.advantage, dynamic_sampling=cfg.algo.dynamic_sampling,
                overlong_buffer=cfg.algo.overlong_buffer,
                overlong_penalty_value=cfg.algo.overlong_penalty,
                max_new_tokens=cfg.rollout.max_new_tokens)
            broadcast_object(batch)
            t0 = time.perf_counter()
            tstats = {} if batch is None else self.learner.train_step(
                batch.tokens, batch.loss_mask, batch.behav_logp, batch.adv,
                staleness=batch.staleness, temperature=cfg.rollout.temperature)
            t_train = time.perf_counter() - t0
            self.version += 1
            self.fleet.inbox.current_version = self.version
            self._last_progress = time.monotonic()
            sstats = self._quantize()
            sstats.update(self._push())
            self._log_step(step, groups, trained, wait_s, bstats, tstats, sstats, t_train,
                           batch.num_tokens if batch is not None else 0)
            if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step != cfg.run.steps:
                last_eval = self._eval(step)
            if step == cfg.run.steps or (cfg.run.ckpt_every and step % cfg.run.ckpt_every == 0):
                save_checkpoint(self.ckpts, self.learner, step, self._state(step))
        if self.start < cfg.run.steps or last_eval is None:
            last_eval = self._eval(cfg.run.steps)
        return last_eval

    def _eval(self, step: int) -> dict:
        if self.engine.version != self.version or step == 0:
            chunks = self.chunks
            if self.cfg.rollout.precision == "fp8_block":  # the local engine is per-channel FP8
                chunks = list(dequantize_named(dict(chunks)).items())
            self.engine.load_weights(iter(chunks), self.version)
        rec = {**self.evaluator.run(step, self.version, self.engine, self.learner),
               "wall": self.wall()}
        self.logger.log(rec)
        self.logger.write(summary(rec))
        return rec

    def _log_step(self, step: int, groups: list[list[Trajectory]], trained: list, wait_s: float,
                  bstats: dict, tstats: dict, sstats: dict, t_train: float, n_tokens: int) -> None:
        rec: dict[str, Any] = {"kind": "train", "step": step, "version": self.version,
                               **rollout_stats(groups, self.version - 1), "time/wait": wait_s,
                               "rollout_tokens_per_s": self._since["new_tokens"]
                               / max(self._since["gen_s"], 1e-9),
                               "dispatch_lag_mean": sum(self.version - 1 - d.version
                                                        for d in trained) / len(trained)}
        rec.update(bstats)
        rec.update(tstats)
        rec.update(sstats)
        rec.update(ack_stats(self.fleet.sync_acks))
        self.fleet.sync_acks = []
        w = self.work
        counts = Counter(w.ledger.stats) + self.fleet.counts + w.counts
        rec.update({f"async/{k}": float(v) for k, v in counts.items()})
        rec.update({f"async/rejects/{k}": float(v) for k, v in self.fleet.rejects().items()})
        rec.update({"async/buffered": float(w.ledger.num_buffered),
                    "async/in_flight": float(w.ledger.num_in_flight),
                    "async/buffer_stale": float(w.buffer.stats.get("stale", 0)),
                    "time/train": t_train, "train_tokens_per_s": n_tokens / max(t_train, 1e-9),
                    "threads/learner": float(torch.get_num_threads()),
                    "threads/workers": float(self.fleet.procs.threads * self.fleet.n)
                    if self.fleet.procs is not None else float("nan"),  # local workers
                    "wall": self.wall()})
        self._since.clear()
        self.logger.log(rec)
        self.trained_log.write(step, trained)

    def close(self) -> None:
        self.fleet.close()
        self.logger.close()
        self.trained_log.close()
