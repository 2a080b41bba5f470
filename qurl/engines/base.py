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
