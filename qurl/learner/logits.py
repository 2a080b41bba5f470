"""Log-probs from the LM head in chunks of positions: no [tokens, vocab/TP] logits held at once.

A policy-gradient step needs, at each loss position j, log p(token_j | tokens_<j) =
log softmax(h_{j-1} Wᵀ / T)[token_j], where h is the final hidden state and W the (vocab-parallel)
head. Computed in one piece, a micro-batch of n positions holds n × vocab/TP logits in the model's
dtype, their fp32 copy and the cross entropy's fp32 softmax for the backward: ~(elem + 12) bytes
per logit. With Qwen's 151,936-row vocabulary at TP 2 and 8,704 positions that is ~9 GB per row,
growing with both the vocabulary and the length.

Here the positions are cut into chunks of `chunk_positions(local_vocab)` (LOGITS_CHUNK logits
each, 256 MiB in fp32): each chunk's head, scaling, padding mask and megatron's vocab-parallel cross
entropy run under `torch.utils.checkpoint`, which keeps only the chunk's hidden states and targets
and recomputes the rest in the backward. At any moment one chunk's logits exist. The values are the
same as the one-piece computation (the same ops on the same rows; only the weight gradient's sum
over positions is split at chunk borders, fp32 rounding). When everything fits in one chunk (the
tiny and SmolLM2 recipes on CPU) nothing is checkpointed: no recompute cost.

Only the loss columns. A response token attends to the whole prompt, so every position runs
through the transformer body, but the head is per position: the learner runs it only from a
micro-batch's first loss column on (`first_loss_columns`; the hidden states are sliced before the
head). On the SmolLM2 recipe (~94-token prompts, 24-token answers, 49,152-row tied head) ~80% of
the positions are prompt.

Entropy. A chunk asked for it (`entropy=True`: the learner asks only in π_prox's passes) also
gives the entropy of the same distribution at every position it scores
(−Σ p log p over the whole vocabulary: the max and two sums all-reduced over the TP group), read
off the logits already there — no extra forward, no gradient. The learner reports its token mean
under π_prox over the loss tokens (`entropy` on every train record): a rollout format that
changes training shows first as a falling policy entropy.

Getting h: `hidden_states_out(model)` makes megatron's GPTModel return its final (normed) hidden
states instead of logits by standing in for the output layer's forward within the block; the head
weight is the output layer's own, or the embedding's when they are tied (`head_weight`). The
tensor-parallel input copy of megatron's ColumnParallelLinear (identity forward, all-reduce of the
gradient backward) is applied once to the whole hidden tensor, as the output layer would.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

LOGITS_CHUNK = 2**26  # logits per chunk (vocab/TP x positions): 256 MiB in fp32


@contextmanager
def hidden_states_out(model: torch.nn.Module) -> Iterator[None]:
    """Within the block `model(tokens, pos, mask)` returns [b, s, h] final hidden states (after
    the final norm) instead of [b, s, V_local] logits."""
    layer = model.output_layer
    if getattr(layer, "sequence_parallel", False):
        raise ValueError("hidden_states_out: the output layer is sequence parallel (hidden states "
                         "sharded along the sequence); not supported")

    def identity(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return hidden, None

    layer.forward = identity  # instance attribute: nn.Module.__call__ finds it first
    try:
        yield
    finally:
        del layer.forward


def first_loss_columns(mask: torch.Tensor) -> torch.Tensor:
    """mask: [B, L] bool -> [B] int64, each row's first True column (L for a row with none)."""
    L = mask.shape[1]
    pos = torch.arange(L, device=mask.device)
    return torch.where(mask, pos, L).min(dim=1).values


def head_weight(model: torch.nn.Module) -> torch.Tensor:
    """[V_local, h]: the head's weight on this TP rank (the embedding's when tied)."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def chunk_positions(local_vocab: int) -> int:
    """Positions per chunk so that one chunk holds at most LOGITS_CHUNK logits (>= 1)."""
    return max(1, LOGITS_CHUNK // max(1, local_vocab))


ENTROPY_BLOCK = 2**23  # logits per block of the entropy's temporaries (32 MiB in fp32)


def _entropy(z: torch.Tensor) -> torch.Tensor:
    """z: [n, V_local] fp32 scaled logits (padded rows -inf) -> [n] entropy of softmax(z) over the
    whole vocabulary (the max and the sums all-reduced over the TP group): H = log S + m − Σ e·z / S
    with e = exp(z − m), S = Σ e. Rows go in blocks of ENTROPY_BLOCK logits, so its temporaries
    stay small next to the chunk itself."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 \
        else None
    m = z.max(dim=-1).values
    if group is not None:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    sums = z.new_empty(2, z.shape[0])
    rows = max(1, ENTROPY_BLOCK // max(1, z.shape[1]))
    for i in range(0, z.shape[0], rows):
        e = torch.exp(z[i:i + rows] - m[i:i + rows, None])
        sums[0, i:i + rows] = e.sum(-1)
        # 0·(−inf) at padded vocab rows is no term; a real NaN logit already made sums[0] NaN
        sums[1, i:i + rows] = e.mul_(z[i:i + rows]).nan_to_num_(nan=0.0).sum(-1)
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    return torch.log(sums[0]) + m - sums[1] / sums[0]


def _chunk_nll(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
               temperature: float, vocab_pad: torch.Tensor | None, entropy: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden: [n, h], weight: [V_local, h], targets: [n] -> ([n] fp32 negative log-likelihoods,
    [n] fp32 entropies of the distribution, detached, when `entropy`)."""
    from megatron.core import tensor_parallel

    # A fresh fp32 tensor: vocab_parallel_cross_entropy overwrites its input in place.
    logits = torch.matmul(hidden, weight.t()).float().div(temperature)
    if vocab_pad is not None:
        logits = logits.masked_fill(vocab_pad, float("-inf"))
    ent = None
    if entropy:
        with torch.no_grad():  # a statistic read off the same logits, before the loss overwrites them
            ent = _entropy(logits.detach())
    return tensor_parallel.vocab_parallel_cross_entropy(logits, targets), ent


def head_logp(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
              temperature: float, vocab_pad: torch.Tensor | None, local_vocab: int,
              entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden: [b, s, h] states at positions j-1; targets: [b, s] tokens at j -> ([b, s] fp32
    log p(target | prefix) under softmax(logits / temperature), differentiable; [b, s] fp32
    entropy of that distribution, detached, or None unless `entropy`), vocab-parallel (a collective over the TP group), in
    chunks of positions (module docstring)."""
    from megatron.core import tensor_parallel

    b, s, h = hidden.shape
    flat = tensor_parallel.copy_to_tensor_model_parallel_region(hidden).reshape(b * s, h)
    tgt = targets.reshape(b * s)
    step = chunk_positions(local_vocab)
    if b * s <= step:
        nll, ent = _chunk_nll(flat, weight, tgt, temperature, vocab_pad, entropy)
        return -nll.view(b, s), None if ent is None else ent.view(b, s)
    grad = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)
    parts = []
    for i in range(0, b * s, step):
        args = (flat[i:i + step], weight, tgt[i:i + step], temperature, vocab_pad, entropy)
        parts.append(checkpoint(_chunk_nll, *args, use_reentrant=False) if grad
                     else _chunk_nll(*args))
    ent = torch.cat([e for _, e in parts]).view(b, s) if entropy else None
    return -torch.cat([n for n, _ in parts]).view(b, s), ent
