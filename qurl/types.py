"""Records that cross component boundaries: requests to engines, what engines return, trajectories.

Only what consumers read lives here. Tensors are CPU tensors; shapes are given per field.
A trajectory is one sampled response to one prompt. It carries, per generated token, the log-prob
under the *behaviour* policy (the engine's 8-bit, possibly stale, weights) and the policy version
that produced that token — in async mode one response may span versions (partial rollout).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # per-request seed; None = engine's own generator
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenRequest:
    """One generation request: a prompt as token ids and how to sample it."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenResult:
    """What an engine returns for one request.

    output_ids: [T] int64 sampled token ids; logprobs: [T] float32 log-prob of each sampled token under
    the engine's own weights at sampling time (after temperature, see engines/base.py);
    versions: [T] int64 policy version of the weights that sampled each token;
    entropy: [T] float32 entropy of the distribution each token was drawn from (after temperature,
    before top-p), or None when the engine does not see it: the local engine gives the whole
    vocabulary's; SGLang, asked for its top k (sglang.top_logprobs), a lower bound from those k
    (qurl/engines/sglang/protocol.py `topk_entropy`).
    """

    rid: str
    prompt_ids: list[int]
    output_ids: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    finish_reason: str  # "stop" (EOS/stop token) | "length" | "abort"
    entropy: torch.Tensor | None = None


@dataclass
class Trajectory:
    """One scored response. prompt_uid identifies the dataset prompt (stable across resume);
    sample_idx is its index within the group of G samples for that prompt."""

    prompt_uid: str
    sample_idx: int
    prompt_ids: torch.Tensor  # [P] int64
    response_ids: torch.Tensor  # [T] int64
    behav_logp: torch.Tensor  # [T] float32
    versions: torch.Tensor  # [T] int64
    reward: float
    finish_reason: str
    reward_timed_out: bool = False
    behav_entropy: torch.Tensor | None = None  # [T] float32, the engine's (GenResult.entropy)
