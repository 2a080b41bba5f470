"""The synchronous loop's batch source: rollouts generated in this process, one version per step.

    sync v0 to the 8-bit engine (UAQ already on the learner's master weights)
    each step: prompts <- data cursor; G samples each from the engine at the current version,
               scored by the verifiable reward (DAPO dynamic sampling: more prompts until B
               groups of mixed accuracy, dynamic_sampling.py); after training, re-quantize
               -> engine (flip fraction measured)

The step around it (batch, train, publish, log, evaluate, checkpoint) is loop.py, shared with
the async pipeline (qurl/pipeline/controller.py), whose η = 0 reduces to this source.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from qurl.data.cursor import DataCursor
from qurl.types import CountingEngine, Engine
from qurl.engines.factory import engine_wire_dtype
from qurl.train.dynamic_sampling import sample_groups
from qurl.weights.publish import WeightSync
from qurl.weights.settings import SyncSettings
from qurl.train.loop import RankZero
from qurl.types import Trajectory


class InProcessRollout:
    """Batch source of the synchronous loop: the engine in this process generates every batch."""

    def __init__(self, z: RankZero) -> None:
        cfg = z.cfg
        if z.engine is None:
            raise ValueError("the synchronous loop generates with rank 0's engine: train_loop "
                             "must build it (engine=True)")
        self.z, self.engine = z, z.engine
        self.cursor = DataCursor(len(z.train_set), seed=cfg.run.seed)
        if z.run.state is not None:
            self.cursor.load_state_dict(z.run.state["cursor"])
        self.sync = WeightSync.of(cfg.rollout.precision, SyncSettings.of(cfg.deploy.sync),
                                  engine_wire_dtype(cfg.rollout, cfg.sglang, z.run.model_dir))

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        return self.sync.push(named, self.engine, version)

    def next_groups(self, step: int,
                    version: int) -> tuple[list[list[Trajectory]], dict[str, float]]:
        cfg = self.z.cfg
        return sample_groups(self.engine, self.z.train_set, self.cursor, self.z.codec,
                             self.z.params, cfg.rollout, rounds=cfg.algo.dynamic_sampling_rounds,
                             seed=cfg.run.seed, reward_timeout_s=cfg.deploy.reward_timeout_s,
                             step=step)

    def step_stats(self, step: int) -> dict[str, float]:
        return self.engine.stats() if isinstance(self.engine, CountingEngine) else {}

    def eval_engine(self, version: int) -> Engine:
        return self.engine  # loaded with every version as it is published

    def clock(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor.state_dict()}

    def close(self) -> None:
        close_engine = getattr(self.engine, "close", None)
        if close_engine is not None:  # SGLang: stop the servers this run launched (they run in
            close_engine()            # their own sessions, so they would outlive the process)

