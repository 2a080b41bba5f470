"""DAPO dynamic sampling in the synchronous loop (`sample_groups`) and the async dispatcher: groups
of uniform accuracy are dropped and more prompts are sampled until the batch holds B groups.

The engine is scripted (a test double of the Engine protocol) so that which groups are uniform is
known: prompt i's answer is right for every sample when i is even, and for half of them when i is
odd. Rewards come from the real verifier (qurl.data.rewards) on the decoded text.
"""
from __future__ import annotations

import pytest
import torch

from qurl.config import ConfigError, load_config
from qurl.data.cursor import DataCursor
from qurl.data.datasets import Example
from qurl.models.tokenizer import build_tokenizer
from qurl.train.dynamic_sampling import informative, sample_groups
from qurl.train.requests import PromptCodec
from qurl.types import GenRequest, GenResult, SamplingParams, Trajectory

DATA = [Example(uid=f"q{i}", prompt=f"{i}+0=", answer=str(i)) for i in range(40)]


class ScriptedEngine:
    """Answers `\\boxed{i}` (right) or `\\boxed{i+1}` (wrong) for prompt q<i>, sample j."""

    def __init__(self) -> None:
        self.tokenizer = build_tokenizer()
        self.vocab_size = len(self.tokenizer)
        self.version = 0
        self.calls: list[int] = []

    def generate(self, requests: list[GenRequest], between_steps=None) -> list[GenResult]:
        self.calls.append(len(requests))
        out = []
        for r in requests:
            uid, j = r.rid.rsplit("#", 1)
            i = int(uid[1:])
            right = i % 2 == 0 or int(j) % 2 == 0
            ids = self.tokenizer.encode(f"\\boxed{{{i if right else i + 1}}}",
                                        add_special_tokens=False)
            n = len(ids)
            out.append(GenResult(r.rid, r.prompt_ids, torch.tensor(ids), torch.full((n,), -0.5),
                                 torch.zeros(n, dtype=torch.int64), "stop"))
        return out

    def load_weights(self, chunks, version: int) -> None:
        self.version = version


def _cfg(dynamic: bool, rounds: int = 16) -> dict:
    """sample_groups' sections and settings, as the synchronous loop hands them."""
    cfg = load_config(sets=[f"algo.dynamic_sampling_rounds={rounds if dynamic else 0}",
                            "rollout.prompts_per_step=4", "rollout.group_size=2",
                            "algo.mini_batches=2"])
    return {"rollout": cfg.rollout, "rounds": cfg.algo.dynamic_sampling_rounds,
            "seed": cfg.run.seed, "reward_timeout_s": cfg.deploy.reward_timeout_s}


def test_dapo_batch_stays_full_when_some_groups_are_uniform() -> None:
    engine = ScriptedEngine()
    cursor = DataCursor(len(DATA), seed=0)
    codec = PromptCodec(engine.tokenizer, "plain")
    groups, stats = sample_groups(engine, DATA, cursor, codec, SamplingParams(max_new_tokens=8),
                                  **_cfg(True), step=1)
    assert len(groups) == 4 and all(len(g) == 2 and informative(g) for g in groups)
    assert all(int(g[0].prompt_uid[1:]) % 2 == 1 for g in groups)  # the odd (mixed) prompts
    assert stats["groups_sampled"] == stats["groups_filtered"] + 4 == cursor.position
    assert stats["sample_rounds"] == len(engine.calls) > 1
    assert engine.calls[0] == 4 * 2  # round 1: B prompts x G; later rounds only what is missing
    assert stats["reward"] == pytest.approx(
        (2 * (stats["groups_sampled"] - 4) + 4) / (2 * stats["groups_sampled"]))
    # without dynamic sampling the uniform groups stay, in one round
    engine = ScriptedEngine()
    groups, stats = sample_groups(engine, DATA, DataCursor(len(DATA), seed=0), codec,
                                  SamplingParams(max_new_tokens=8), **_cfg(False), step=1)
    assert len(groups) == 4 and len(engine.calls) == 1 and "groups_filtered" not in stats


def test_too_many_rounds_is_a_clear_error() -> None:
    engine = ScriptedEngine()
    everything_right = [ex for ex in DATA if int(ex.uid[1:]) % 2 == 0]
    with pytest.raises(RuntimeError, match="algo.dynamic_sampling_rounds"):
        sample_groups(engine, everything_right, DataCursor(len(everything_right), seed=0),
                      PromptCodec(engine.tokenizer, "plain"), SamplingParams(max_new_tokens=8),
                      **_cfg(True, rounds=3), step=1)
    assert len(engine.calls) == 3


def test_batch_must_split_into_mini_batches_times_dp() -> None:
    with pytest.raises(ConfigError, match="algo.mini_batches=3"):
        load_config(sets=["algo.dynamic_sampling_rounds=16", "algo.mini_batches=3"])
    with pytest.raises(ConfigError, match="learner.dp=3"):
        load_config(sets=["algo.dynamic_sampling_rounds=16", "learner.dp=3"])
    with pytest.raises(ConfigError, match="algo.dynamic_sampling_rounds"):
        load_config(sets=["algo.dynamic_sampling_rounds=-1"])


def _group(key: str, version: int, rewards: list[float]) -> list[Trajectory]:
    return [Trajectory(prompt_uid=key, sample_idx=j, prompt_ids=torch.tensor([1, 2]),
                       response_ids=torch.tensor([3] * (j + 1)), behav_logp=torch.full((j + 1,), -1.0),
                       versions=torch.full((j + 1,), version), reward=r, finish_reason="stop")
            for j, r in enumerate(rewards)]


def test_async_dispatcher_filters_uniform_groups_and_sends_replacements() -> None:
    from qurl.pipeline.dispatch import Dispatcher

    B, G = 4, 2
    work = Dispatcher(DATA, batch_size=B, group_size=G, max_staleness=0, total_steps=2, seed=0,
                      encode=lambda s: [5] * len(s), params=SamplingParams(),
                      dynamic_sampling=True)
    sent: list[str] = []
    answered = 0

    def send(slot, meta, tensors):
        sent.append(meta["key"])
        return True

    for _ in range(20):
        work.dispatch(0, [0], send)
        for key in sent[answered:]:  # the worker answers: every other prompt all wrong
            uniform = answered % 2 == 0
            work.accept(_group(key, 0, [0.0, 0.0] if uniform else [1.0, 0.0]), 0)
            answered += 1
        popped = work.pop_batch(0)
        if popped is not None:
            break
    groups, dispatches = popped
    assert len(groups) == B and all(informative(g) for g in groups)
    assert len(sent) == 2 * B and work.ledger.stats["dropped_uniform"] == B
    assert work.ledger.num_in_flight == 0 and work.ledger.num_buffered == 0
    assert work.staleness.accepted == B and work.staleness.running == 0
