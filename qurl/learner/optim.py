"""The learner's optimizer pieces: LR schedule, TP-correct global grad norm, clipping, AdamW groups.

With tensor parallelism a parameter is either sharded across the TP ranks (linears, the
vocab-parallel embedding) or replicated (RMSNorm gains); which one comes from
`qurl.models.convert.partition_dim` (megatron only tags parameters it initializes itself). Without
sequence parallelism a replicated parameter gets the same gradient on every rank, so the global L2
norm of the full model's gradient is

    sqrt( all_reduce_sum_over_TP( Σ_sharded ||g||² + [tp_rank == 0] · Σ_replicated ||g||² ) )

— each shard counted once, each replicated tensor counted once. Every rank gets the same norm, so
every rank clips by the same factor and skips (non-finite norm) the same steps. Squares are summed
in float64 so TP=1 and TP=2 agree to ~1e-12 relative, far inside the 1e-5 the tests ask.

LR schedule (`lr_at`), per learner step k = 0, 1, ...: linear warmup `lr·(k+1)/warmup_steps` for
k < warmup_steps, then `constant` lr or `cosine` decay `lr·½(1+cos(π·p))`, p = (k−warmup)/(total−warmup).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from qurl.config import OptimConfig


def lr_at(optim: OptimConfig, step: int, total_steps: int) -> float:
    """Learning rate of learner step `step` (0-based) in a run of `total_steps` steps."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    if optim.schedule == "cosine":
        span = max(1, total_steps - optim.warmup_steps)
        p = min(1.0, (step - optim.warmup_steps) / span)
        return optim.lr * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"optim.schedule={optim.schedule!r}: must be constant or cosine")


def global_grad_norm(grads: Sequence[torch.Tensor | None], sharded: Sequence[bool], *, tp_rank: int,
                     tp_group: dist.ProcessGroup | None, tp_size: int) -> float:
    """L2 norm of the full (unsharded) gradient; grads[i] belongs to a parameter that is TP-sharded
    iff sharded[i]. A collective over the TP group when tp_size > 1."""
    device = next((g.device for g in grads if g is not None), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g, is_sh in zip(grads, sharded, strict=True):
        if g is None or (not is_sh and tp_rank != 0):
            continue
        total += g.detach().double().pow(2).sum()
    if tp_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=tp_group)
    return float(total.sqrt())


def clip_(grads: Iterable[torch.Tensor | None], norm: float, max_norm: float) -> float:
    """Scale grads in place so their norm is at most max_norm (megatron's rule: coefficient
    max_norm / (norm + 1e-6), applied when < 1). max_norm <= 0 disables clipping. Returns the factor."""
    if max_norm <= 0:
        return 1.0
    coeff = max_norm / (norm + 1e-6)
    if coeff >= 1.0:
        return 1.0
    for g in grads:
        if g is not None:
            g.mul_(coeff)
    return coeff


def adamw(named_params: Sequence[tuple[str, torch.nn.Parameter]], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed, as in
    megatron). Group 0 decays, group 1 does not; the LR is set per step by the learner."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.adam_eps)
