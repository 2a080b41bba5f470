"""The rollout-engine interface every engine implements (local torch decoder, SGLang over HTTP).

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
  what it holds (`verify(digests)`, digests of qurl/wire/digest.py). `can_verify` may turn False
  at run time (an SGLang TP > 1 server whose cut qurl cannot map): use `verifiable(engine)`.
- `AdoptingEngine`: `load_weights(..., adopt=True)` may keep the chunks' memory as its own
  weights instead of copying (`adopted` says whether the last load did), so a receiver hands it
  buffers it will not write again (qurl/sync/receiver.py).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch

from qurl.types import GenRequest, GenResult


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
        that version (qurl/wire/delta.py), refused with StaleBase unless it holds exactly it."""
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
