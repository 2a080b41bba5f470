"""Records and interfaces that cross rooms: requests to engines, what engines return,
trajectories, and the rollout-engine interface.

Only what consumers read lives here. Tensors are CPU tensors; shapes are given per field.
A trajectory is one sampled response to one prompt. It carries, per generated token, the log-prob
under the *behaviour* policy (the engine's 8-bit, possibly stale, weights) and the policy version
that produced that token — in async mode one response may span versions (partial rollout).

The rollout-engine interface (`Engine`, below) every engine implements (qurl/engines/: the local
torch decoder, SGLang over HTTP). It lives here, under every room, because the rooms that drive
an engine (weights/, train/, pipeline/) reach it only through this contract.

An engine samples responses with its own — usually 8-bit — copy of the policy and reports, per
sampled token, the log-prob under those weights and the policy version that sampled it. It receives
new weights as a stream of (HF name, tensor) chunks; for quantized linears the chunk pair is
`<name>.weight` (int8 / float8_e4m3fn codes, [out, in]) and `<name>.weight_scale` (fp32, [out, 1]),
the layout SGLang's w8a8_int8 / fp8 per-channel methods hold. Everything else arrives in full
precision under its HF name.

Log-probs are of the distribution actually sampled from: softmax(logits / temperature), no top-p
renormalisation (top-p only restricts sampling), matching SGLang's `return_logprob` semantics with
temperature applied.

Two optional capabilities, declared here as protocols and tested with `isinstance` (never probed
with getattr):
- `VerifiableEngine`: takes a delta against the version it holds (`load_weights(..., base=)`,
  refusing with `StaleBase` before writing anything when it does not hold that base) and proves
  what it holds (`verify(digests)`, digests of qurl/weights/digest.py). `can_verify` may turn False
  at run time (an SGLang TP > 1 server whose cut qurl cannot map): use `verifiable(engine)`.
- `AdoptingEngine`: `load_weights(..., adopt=True)` may keep the chunks' memory as its own
  weights instead of copying (`adopted` says whether the last load did), so a receiver hands it
  buffers it will not write again (qurl/weights/receiver.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

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
    the engine's own weights at sampling time (after temperature, see qurl/types.py);
    versions: [T] int64 policy version of the weights that sampled each token;
    entropy: [T] float32 entropy of the distribution each token was drawn from (after temperature,
    before top-p), or None when the engine does not see it: the local engine gives the whole
    vocabulary's; SGLang, asked for its top k (sglang.top_logprobs), a lower bound from those k
    (qurl/engines/sglang/protocol.py `topk_entropy`).
    routed_experts: [P + T - 1, L, k] uint8, for a Mixture-of-Experts model (None otherwise): the k
    experts the engine's router chose in each of its L MoE layers (model order) at every position it
    forwarded, the prompt's and the completion's but the last sampled token's (which it never
    forwarded); SGLang's `return_routed_experts` has this shape (int32 there, uint8 here: E <= 256).
    The learner replays them (algo.routing_replay) and compares its own choice with them.
    """

    rid: str
    prompt_ids: list[int]
    output_ids: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    finish_reason: str  # "stop" (EOS/stop token) | "length" | "abort"
    entropy: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None  # [P + T - 1, L, k] uint8 (MoE only)


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
    routed_experts: torch.Tensor | None = None  # [P + T - 1, L, k] uint8 (GenResult.routed_experts)


# ---- the rollout-engine interface

@runtime_checkable
class Engine(Protocol):
    tokenizer: Any  # the served model's HF tokenizer (prompts are encoded with it)
    vocab_size: int  # token ids the model accepts: [0, vocab_size)

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded."""
        ...

    def generate(
        self,
        requests: list[GenRequest],
        between_steps: Callable[[], None] | None = None,
    ) -> list[GenResult]:
        """Sample all requests to completion. `between_steps`, if given, is called between decode
        steps; it may call `load_weights` (a weight update landing mid-generation: later tokens are
        sampled and tagged with the new version — partial rollout)."""
        ...

    def load_weights(self, chunks: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace weights by name; commit `version` only after the last chunk is applied.
        Unknown names or mismatched shapes raise ValueError naming the tensor."""
        ...

    def close(self) -> None:
        """Release what the engine holds outside this process: SGLang servers qurl launched (they
        run in their own sessions, so they would outlive it) and its weight group. Whoever makes
        an engine closes it, also on errors; closing twice is harmless."""
        ...


class StaleBase(ValueError):
    """A delta computed against a version the engine does not hold (exactly): resync in full."""


@runtime_checkable
class VerifiableEngine(Engine, Protocol):
    """An engine that applies deltas and proves what it holds (module docstring)."""

    @property
    def digest(self) -> str | None:
        """Combined digest of the version it last verified (None: not verified)."""
        ...

    @property
    def can_verify(self) -> bool:
        """Whether deltas and `verify` work now (False: full, unverified syncs only)."""
        ...

    def load_weights(self, chunks: Iterable[tuple[str, torch.Tensor]], version: int, *,
                     base: tuple[int, str] | None = None) -> None:
        """As Engine.load_weights; with `base` = (v-1, digest) the chunks are a delta against
        that version (qurl/weights/delta.py), refused with StaleBase unless it holds exactly it."""
        ...

    def verify(self, digests: dict[str, str]) -> list[str]:
        """Compare what it holds with {name: digest}: the names that differ ([]: all match)."""
        ...


@runtime_checkable
class AdoptingEngine(Engine, Protocol):
    """An engine that can take the received buffers as its weights (module docstring)."""

    adopted: bool  # whether the last load_weights kept the chunks' memory

    def load_weights(self, chunks: Iterable[tuple[str, torch.Tensor]], version: int, *,
                     base: tuple[int, str] | None = None, adopt: bool = False) -> None:
        ...


@runtime_checkable
class CountingEngine(Engine, Protocol):
    """An engine that keeps counters of its own health (an SGLang engine: servers found stalled,
    restarted, dropped), reported in every train record."""

    def stats(self) -> dict[str, float]:
        """{record key: count since the engine started}."""
        ...


def verifiable(engine: Engine) -> VerifiableEngine | None:
    """`engine` when it can take deltas and verify right now, else None."""
    return engine if isinstance(engine, VerifiableEngine) and engine.can_verify else None
