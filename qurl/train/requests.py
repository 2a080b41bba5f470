"""Rollout requests: the prompt codec, and G seeded generation requests per prompt.

A prompt is rendered with the configured chat template and tokenized (`PromptCodec`); each of its G
samples becomes one `GenRequest` whose sampling seed is derived from (run seed, step, prompt uid,
sample index) (`request_seed`), so a resumed run samples exactly what an uninterrupted one would,
whatever the batch composition, and the async dispatcher (qurl/pipeline/dispatch.py) asks for the
same samples as the sync loop. Generating and scoring them is generate.py.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from qurl.data.datasets import Example
from qurl.data.templates import render_prompt
from qurl.types import GenRequest, SamplingParams


def request_seed(run_seed: int, step: int, uid: str, sample_idx: int) -> int:
    digest = hashlib.sha256(f"{run_seed}/{step}/{uid}/{sample_idx}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class PromptCodec:
    """Renders a question with the configured template and tokenizes it; decodes responses."""

    tokenizer: object
    template: str = "plain"

    def encode(self, question: str) -> list[int]:
        text = render_prompt(question, self.template, tokenizer=self.tokenizer)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: torch.Tensor) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)


def make_requests(examples: Sequence[Example], prompt_ids: Sequence[list[int]],
                  params: SamplingParams, *, group_size: int, run_seed: int, step: int,
                  keys: Sequence[str] | None = None) -> list[GenRequest]:
    """G requests per example (prompt_ids[i]: its encoded prompt), ids `<key>#<j>`.

    key is the example's uid, or what the caller names its responses by (`keys[i]`: the async
    dispatch key `uid@did`). The seed of sample j is request_seed(run_seed, step, uid, j) with the
    dataset uid, so a prompt trained at a step samples the same responses in every mode."""
    keys = [ex.uid for ex in examples] if keys is None else keys
    reqs = []
    for ex, ids, key in zip(examples, prompt_ids, keys, strict=True):
        for j in range(group_size):
            seeded = replace(params, seed=request_seed(run_seed, step, ex.uid, j))
            reqs.append(GenRequest(rid=f"{key}#{j}", prompt_ids=ids, params=seeded))
    return reqs
