"""DAPO dynamic sampling: train only on groups whose answers disagree, and keep the batch full.

A group whose G samples are all right or all wrong has zero advantage under GRPO: it adds nothing
but noise and dilutes the token-mean loss. DAPO (Yu et al., 2025) drops such groups and samples
more prompts until the batch again holds B groups, so every step trains on the same number of
informative groups (and B·G stays divisible by mini-batches × data-parallel ranks).

Uniformity is judged on ACCURACY, i.e. `Trajectory.reward`, the verifiable 0/1 reward before any
shaping: an all-wrong group whose answers differ in length must not survive because DAPO's
overlong penalty gives it different shaped rewards (it would then be trained on length alone).

The synchronous loop calls `sample_groups`: rounds of rollout on fresh prompts from the data cursor,
each round asking for exactly the groups still missing, so no informative group is thrown away and
a resumed run's cursor says exactly which prompts were used (filtered prompts are consumed, as in
DAPO; they come back next epoch). The async dispatcher applies the same `informative` test to each
group as it completes (qurl/pipeline/dispatch.py).
"""
from __future__ import annotations

from typing import Sequence

from qurl.config import RolloutConfig
from qurl.data.cursor import DataCursor
from qurl.data.datasets import Example
from qurl.types import Engine
from qurl.train.generate import group_stats, rollout as generate
from qurl.train.requests import PromptCodec
from qurl.types import SamplingParams, Trajectory

_SAMPLED_KEYS = ("reward", "response_len", "truncated_frac", "reward_timeouts")


def informative(group: Sequence[Trajectory]) -> bool:
    """True when the group's accuracies (verifiable rewards, before shaping) are not all equal."""
    return len({t.reward for t in group}) > 1


def _merge(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Rollout stats of several rounds (stats, trajectories): times and counts add up, per-sample
    means are weighted by the round's samples, throughput is recomputed from the totals."""
    if len(parts) == 1:
        return dict(parts[0][0])
    n = sum(k for _, k in parts)
    out = {key: sum(s[key] for s, _ in parts) for key in ("time/generate", "time/reward",
                                                         "reward_timeouts")}
    for key in ("reward", "response_len", "truncated_frac"):
        out[key] = sum(s[key] * k for s, k in parts) / n
    out["rollout_tokens_per_s"] = out["response_len"] * n / max(out["time/generate"], 1e-9)
    return out


def sample_groups(engine: Engine, train_set: Sequence[Example], cursor: DataCursor,
                  codec: PromptCodec, params: SamplingParams, rollout: RolloutConfig, *,
                  rounds: int, seed: int, reward_timeout_s: float,
                  step: int) -> tuple[list[list[Trajectory]], dict[str, float]]:
    """The groups one synchronous step trains on: rollout.prompts_per_step groups of
    rollout.group_size samples, from prompts taken off `cursor`. With `rounds`
    (algo.dynamic_sampling_rounds) > 0, groups that are not `informative` are dropped and more
    prompts are sampled until the batch is full; needing more than that many rounds is an error
    (the data is too easy or too hard for the policy). seed: run.seed (the requests' seeds);
    reward_timeout_s: deploy.reward_timeout_s. Returns (groups, rollout stats; with dynamic
    sampling also sample_rounds, groups_sampled, groups_filtered)."""
    want, G = rollout.prompts_per_step, rollout.group_size
    groups: list[list[Trajectory]] = []
    parts: list[tuple[dict[str, float], int]] = []
    sampled = 0
    # rounds = 0: dynamic sampling off, one round keeps every group
    while len(groups) < want:
        if rounds and len(parts) == rounds:
            raise RuntimeError(
                f"algo.dynamic_sampling_rounds: step {step} found {len(groups)} of {want} groups "
                f"with mixed accuracy in {sampled} sampled prompts ({len(parts)} rounds = "
                f"algo.dynamic_sampling_rounds); every other group was all right or all wrong")
        examples = [train_set[i] for i in cursor.take(want - len(groups))]
        got, stats = generate(engine, examples, codec, params, group_size=G,
                              run_seed=seed, step=step, reward_timeout_s=reward_timeout_s)
        sampled_stats = group_stats(got, step - 1)  # every response of the round, kept or not
        stats.update({key: sampled_stats[key] for key in _SAMPLED_KEYS})
        parts.append((stats, len(examples) * G))
        sampled += len(got)
        groups += [g for g in got if informative(g)] if rounds else got
    out = _merge(parts)
    if rounds:
        out.update({"sample_rounds": float(len(parts)), "groups_sampled": float(sampled),
                    "groups_filtered": float(sampled - len(groups))})
    return groups, out
