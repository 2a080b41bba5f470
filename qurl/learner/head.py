"""The LM head only where the loss reads it: skip the vocabulary projection on prompt positions.

A policy-gradient step needs log p(token_j | tokens_<j) only at response positions j (the loss
mask), and that log-prob reads the logits at position j - 1. Every position still has to run
through the transformer body (a response token attends to the whole prompt), but the head — the
[hidden x vocab] projection, its fp32 copy, the softmax and their gradients — is per position and
needs to run only from the first response position of the micro-batch on.

That matters when prompts are long next to the responses and the vocabulary is large. The recipe
on SmolLM2-135M (qurl/presets, `smollm2-arith`) has ~94-token prompts, 24-token answers and a
49,152-row tied head (576 x 49,152 = 28M multiply-adds per position against ~120M for the 30
layers); per row, ~80% of the positions are prompt.

`head_from(model, first)` slices the hidden states megatron's GPTModel hands its output layer:
[s, b, h] -> [s - first, b, h] (a forward pre-hook on `model.output_layer`, so nothing of the
model's own forward is copied here). The logits then come back as [b, s - first, V_local] and
position i of them is position first + i of the sequence. Sequence parallelism shards the hidden
states along s before the output layer gathers them, so a slice there would be wrong: refused.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def head_from(model: torch.nn.Module, first: int) -> Iterator[None]:
    """Within the block, `model(...)` returns logits for sequence positions [first, s) only
    ([b, s - first, V_local]); first = 0 changes nothing."""
    if first <= 0:
        yield
        return
    layer = model.output_layer
    if getattr(layer, "sequence_parallel", False):
        raise ValueError("head_from: the output layer is sequence parallel (hidden states "
                         "sharded along the sequence); slicing positions there is not supported")

    def cut(_mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        hidden = args[0]  # [s, b, h]
        if first >= hidden.shape[0]:
            raise ValueError(f"head_from: first position {first} is past the sequence "
                             f"({hidden.shape[0]} positions)")
        return (hidden[first:], *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(cut, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def first_loss_columns(mask: torch.Tensor) -> torch.Tensor:
    """mask: [B, L] bool -> [B] int64, each row's first True column (L for a row with none)."""
    L = mask.shape[1]
    pos = torch.arange(L, device=mask.device)
    return torch.where(mask, pos, L).min(dim=1).values
