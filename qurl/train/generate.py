"""Rollout: prompts in, scored trajectories out — the generation half of an RLVR step.

For each prompt, G responses are sampled from the engine (8-bit weights in QuRL), each token with the
behaviour log-prob and the policy version that sampled it; every response is decoded and scored by
the verifiable reward. The requests and their seeds are requests.py.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from qurl.data.datasets import Example
from qurl.data.rewards import score_batch
from qurl.types import Engine
from qurl.train.requests import PromptCodec, make_requests
from qurl.types import GenRequest, GenResult, SamplingParams, Trajectory


def to_trajectories(results: list[GenResult], examples: list[Example], codec: PromptCodec, *,
                    reward_timeout_s: float) -> list[list[Trajectory]]:
    """Score results (ordered as make_requests made them) and group them per prompt."""
    by_uid = {ex.uid: ex for ex in examples}
    texts = [codec.decode(r.output_ids) for r in results]
    asked = [by_uid[r.rid.rsplit("#", 1)[0]] for r in results]
    scores = score_batch(texts, [ex.answer for ex in asked], timeout_s=reward_timeout_s,
                         kinds=[ex.answer_kind for ex in asked])
    groups: dict[str, list[Trajectory]] = {}
    for res, sc in zip(results, scores):
        t = _trajectory(res, float(sc.reward), sc.timed_out)
        groups.setdefault(t.prompt_uid, []).append(t)
    return [groups[ex.uid] for ex in examples if ex.uid in groups]


def _trajectory(res: GenResult, reward: float, timed_out: bool) -> Trajectory:
    uid, j = res.rid.rsplit("#", 1)
    return Trajectory(prompt_uid=uid, sample_idx=int(j),
                      prompt_ids=torch.tensor(res.prompt_ids, dtype=torch.int64),
                      response_ids=res.output_ids.to(torch.int64), behav_logp=res.logprobs.float(),
                      versions=res.versions.to(torch.int64), reward=reward,
                      finish_reason=res.finish_reason, reward_timed_out=timed_out,
                      behav_entropy=None if res.entropy is None else res.entropy.float(),
                      routed_experts=res.routed_experts)  # [P + T - 1, L, k] (MoE), kept as sent


def unscored(results: list[GenResult]) -> list[Trajectory]:
    """Results (rids `<key>#<j>`) as trajectories with reward 0, for whoever scores them itself:
    an async worker's answers to evaluation requests travel so to the evaluator
    (qurl/pipeline/remote_eval.py)."""
    return [_trajectory(res, 0.0, False) for res in results]


def generate_groups(engine: Engine, requests: list[GenRequest], examples: list[Example],
                    codec: PromptCodec, *, reward_timeout_s: float,
                    between_steps: Callable[[], None] | None = None,
                    ) -> tuple[list[list[Trajectory]], dict[str, float]]:
    """Generate `requests` (as make_requests made them for `examples`, whose uids are the request
    keys) and score them. Returns (groups, {"time/generate", "time/reward", "new_tokens"})."""
    t0 = time.perf_counter()
    results = engine.generate(requests, between_steps=between_steps)
    t1 = time.perf_counter()
    groups = to_trajectories(results, examples, codec, reward_timeout_s=reward_timeout_s)
    return groups, {"time/generate": t1 - t0, "time/reward": time.perf_counter() - t1,
                    "new_tokens": float(sum(len(r.output_ids) for r in results))}


def rollout(engine: Engine, examples: list[Example], codec: PromptCodec, params: SamplingParams, *,
            group_size: int, run_seed: int, step: int, reward_timeout_s: float,
            between_steps: Callable[[], None] | None = None) -> tuple[list[list[Trajectory]], dict]:
    """Sample G responses per prompt and score them. Returns (groups, timing/throughput stats);
    the statistics of the groups themselves are `group_stats`."""
    reqs = make_requests(examples, [codec.encode(ex.prompt) for ex in examples], params,
                         group_size=group_size, run_seed=run_seed, step=step)
    groups, gen = generate_groups(engine, reqs, examples, codec, reward_timeout_s=reward_timeout_s,
                                  between_steps=between_steps)
    return groups, {"time/generate": gen["time/generate"], "time/reward": gen["time/reward"],
                    "rollout_tokens_per_s": gen["new_tokens"] / max(gen["time/generate"], 1e-9)}


def group_stats(groups: list[list[Trajectory]], trained_version: int) -> dict[str, float]:
    """Reward / length / truncation of a batch's responses, per-token staleness relative to
    the version that trains them (staleness = trained_version − version that sampled the token)
    and, where the engine reported it, `behav_entropy`: the token mean of the behaviour policy's
    entropy at every sampled token, the engine's view beside the learner's π_prox `entropy`."""
    trajs = [t for g in groups for t in g]
    if not trajs:
        raise ValueError("group_stats: empty batch")
    n_new = sum(len(t.response_ids) for t in trajs)
    out = {"reward": sum(t.reward for t in trajs) / len(trajs),
           "response_len": n_new / len(trajs),
           "truncated_frac": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
           "reward_timeouts": float(sum(t.reward_timed_out for t in trajs))}
    if n_new:
        stale = torch.cat([trained_version - t.versions for t in trajs])
        out["staleness_mean"] = float(stale.float().mean())
        out["staleness_max"] = float(stale.max())
    seen = [t.behav_entropy for t in trajs if t.behav_entropy is not None]
    if seen and sum(h.numel() for h in seen):
        out["behav_entropy"] = float(torch.cat(seen).double().mean())
    return out

