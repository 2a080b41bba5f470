"""The asynchronous batch source: learner rank 0 is the controller of a fleet of rollout workers.

    publish(v):   quantize the learner's weights -> broadcast to every worker (weight group);
                  they load it between decode steps
    next_groups:  dispatch prompts to workers while (η + version + 1)·B − (accepted + running) > 0;
                  receive trajectory batches (authenticated, validated); buffer complete groups;
                  return once B are buffered (the earliest completed, in dispatch order)

The controller is a batch source of the one training loop (qurl/train/loop.py), as the synchronous
in-process rollout (qurl/train/inline.py) is another: same step, batch assembly, learner call, records and
checkpoint cadence, and the workers build their requests with the sync loop's `make_requests`. With
η = 0 only B prompts are ever outstanding, all dispatched at the current version, so each step
trains exactly what the sync loop would (up to the float noise of running the same decoder in
another process). With η ≥ 1 generation of the next batches overlaps training and weight sync;
responses may span versions (partial rollout) and the learner sees per-token staleness.

Nothing is lost or trained twice (dispatch.py, ledger.py): every dataset index taken
from the cursor is in flight at one worker, buffered, trained, or put back. A dead worker's prompts
are put back and re-dispatched; a group that became too stale is dropped and its prompt put back;
late output of a replaced worker is dropped. The checkpoint holds the cursor, the buffer
(trajectories received but not trained), the staleness counters and the ledger; on resume the
prompts that were in flight go back to the cursor. `trained.jsonl` lists the prompt uids of every step (truncated on resume like
metrics.jsonl), so exactly-once can be checked.

Re-broadcasts to replaced workers use the chunks cached on rank 0, so they need no collective of the
TP ranks (which run the loop without a source). Rank 0 builds no engine: evaluation
(qurl/train/loop.py, qurl/train/eval_suite.py) asks the workers, through their task path, for the
answers of the 8-bit actor they run at the version just published (remote_eval.py),
and scores beside it the full-precision policy (a local decoder, eval.fp_policy).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

import torch

from qurl.engines.factory import engine_wire_dtype
from qurl.engines.kind import EngineKind
from qurl.models.moe import route_shape
from qurl.node.placement import learner_threads
from qurl.pipeline.dispatch import Dispatcher
from qurl.pipeline.records import TrainedLog, ack_stats
from qurl.pipeline.remote_eval import WorkerEval
from qurl.weights.publish import WeightSync
from qurl.weights.settings import SyncSettings
from qurl.train.loop import RankZero
from qurl.types import Trajectory

log = logging.getLogger("qurl.controller")

STALL_TIMEOUT_S = 900.0  # no trajectory accepted and no step trained for this long: give up
TRAINED_FILE = "trained.jsonl"


class Controller:
    """Batch source of the async loop: a fleet of rollout workers fed under the staleness bound."""

    def __init__(self, z: RankZero) -> None:
        from qurl.pipeline.fleet import Fleet
        from qurl.pipeline.session import load_or_create_key

        cfg = self.cfg = z.cfg
        self.run_dir, self.version = Path(z.run.run_dir), z.run.start
        self.codec = z.codec
        self.work = Dispatcher(z.train_set, batch_size=cfg.rollout.prompts_per_step,
                               group_size=cfg.rollout.group_size,
                               max_staleness=cfg.rollout.max_staleness,
                               total_steps=cfg.run.steps, seed=cfg.run.seed,
                               encode=self.codec.encode, params=z.params,
                               dynamic_sampling=cfg.algo.dynamic_sampling_rounds > 0)
        self.wall0, self.wall_offset = time.monotonic(), 0.0
        if z.run.state is not None:
            self._restore(z.run.state)
        self.trained_log = TrainedLog(self.run_dir / TRAINED_FILE, z.run.start)
        key = load_or_create_key(self.run_dir, cfg.deploy.stream.key)
        self.chunks: list[tuple[str, torch.Tensor]] = []
        sync, d = SyncSettings.of(cfg.deploy.sync), cfg.deploy
        # What passes through is sent in the workers' engines' dtype (bf16/fp16 for SGLang)
        self.sync = WeightSync.of(cfg.rollout.precision, sync,
                                  engine_wire_dtype(cfg.rollout, cfg.sglang, z.run.model_dir))
        self.fleet = Fleet(self.run_dir, key, z.run.model_dir, engines=d.engines, host=d.host,
                           stream=d.stream, sync=sync, kind=EngineKind.of(cfg.rollout, cfg.sglang),
                           vocab_size=z.vocab_size,
                           max_len=max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens),
                           spawn=d.rollout == "workers",
                           # each local worker gets the learner's share of the node's cores
                           worker_threads=learner_threads(cfg.learner, cfg.rollout, d),
                           planner=self.sync.planner,  # one compare pass: flips + delta
                           moe=_route_shape(z.run.model_dir))
        self.fleet.inbox.current_version = self.version
        self.evals = WorkerEval(self.fleet, z.tokenizer, self._tend, self._accept)
        self._since: Counter[str] = Counter()  # rollout throughput since the last train record
        self._trained: list = []  # the dispatches of the batch being trained
        self._last_progress = time.monotonic()
        self.fleet.start()

    # ------------------------------------------------------------------ state

    def _restore(self, state: dict) -> None:
        self.wall_offset = float(state.get("wall", 0.0))
        lost = self.work.load_state_dict(state, self.version)
        log.info("resumed at step %d: %d groups buffered, %d prompts re-dispatched",
                 self.version, self.work.ledger.num_buffered, lost)

    def state_dict(self) -> dict:
        """The controller's part of state.pt: wall clock, and the dispatcher's cursor, buffer
        (trajectories received but not trained), staleness counters and ledger (prompts in
        flight)."""
        return {"wall": self.wall(), "mode": "async", **self.work.state_dict()}

    def wall(self) -> float:
        return self.wall_offset + time.monotonic() - self.wall0

    def clock(self) -> dict[str, float]:
        return {"wall": self.wall()}

    # ------------------------------------------------------------------ weights

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Gather + quantize the learner's weights of `version` (a collective with the other TP
        ranks) and broadcast them to every worker."""
        self.version = self.fleet.inbox.current_version = version
        self._last_progress = time.monotonic()
        self.chunks, stats = self.sync.quantize(named)
        stats.update(self._push())
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
        """File one trajectory message (channel.py has already authenticated and validated it);
        answers to evaluation requests go to the evaluation, never to training."""
        if msg.meta.get("eval"):
            self.evals.file(msg)
            return
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
            self._tend()
            self.work.dispatch(self.version, self.fleet.ready_slots(), self._send)
            for msg in self.fleet.poll(timeout_ms=20):
                self._accept(msg)
            popped = self.work.pop_batch(self.version)
            if popped is not None:
                return popped[0], popped[1], time.perf_counter() - t0
            if time.monotonic() - self._last_progress > STALL_TIMEOUT_S:
                raise RuntimeError(f"no trajectories for {STALL_TIMEOUT_S:.0f}s; see "
                                   f"{self.run_dir / 'workers'}")

    # ------------------------------------------------------------------ the loop's hooks

    def next_groups(self, step: int,
                    version: int) -> tuple[list[list[Trajectory]], dict[str, float]]:
        groups, self._trained, wait_s = self._collect()
        return groups, {"time/wait": wait_s,
                        "dispatch_lag_mean": sum(version - d.version for d in self._trained)
                        / len(self._trained)}

    def step_stats(self, step: int) -> dict[str, float]:
        """Throughput, sync acks and the pipeline's counters since the last step; records the
        step's prompts in trained.jsonl."""
        if self.fleet.halted is not None:  # before this step's record and checkpoint are written
            raise self.fleet.halted
        rec = {"rollout_tokens_per_s": self._since["new_tokens"] / max(self._since["gen_s"], 1e-9),
               **ack_stats(self.fleet.sync_acks)}
        self.fleet.sync_acks = []
        w = self.work
        counts = Counter(w.ledger.stats) + self.fleet.counts + w.counts + self.evals.counts
        rec.update({f"async/{k}": float(v) for k, v in counts.items()})
        rec.update({f"async/rejects/{k}": float(v) for k, v in self.fleet.rejects().items()})
        rec.update({"async/buffered": float(w.ledger.num_buffered),
                    "async/in_flight": float(w.ledger.num_in_flight),
                    "async/buffer_stale": float(w.buffer.stats.get("stale", 0)),
                    "threads/workers": float(self.fleet.procs.threads * self.fleet.n)
                    if self.fleet.procs is not None else float("nan")})  # local workers
        self._since.clear()
        self.trained_log.write(step, self._trained)
        return rec

    def _tend(self) -> list[int]:
        """Housekeeping between polls: raise a halt, restart dead workers (their prompts go back
        to the cursor), re-push the version when the group or a worker needs it. Returns the
        slots replaced."""
        if self.fleet.halted is not None:  # a worker failed verification twice in a row
            raise self.fleet.halted
        self.fleet.check_procs()
        replaced = self.fleet.take_replaced()
        for slot in replaced:
            self.work.reclaim(slot)
        while self.fleet.need_group or self.fleet.need_full:
            self._push()
            self.fleet.check_procs()
            for slot in self.fleet.take_replaced():  # died during the push
                self.work.reclaim(slot)
                replaced.append(slot)
        return replaced

    def eval_engine(self, version: int) -> WorkerEval:
        """The workers, answering the evaluation of `version` (remote_eval.py)."""
        self.evals.version = version
        return self.evals

    def close(self) -> None:
        self.fleet.close()
        self.trained_log.close()


def _route_shape(model_dir: str | Path) -> tuple[int, int, int] | None:
    """(L, k, E) of a mixture-of-experts checkpoint (its trajectories' routed_experts), else None."""
    import json

    path = Path(model_dir) / "config.json"
    return route_shape(json.loads(path.read_text())) if path.is_file() else None
