"""How many sequences one learner micro-batch holds: a memory budget, measured on GPU.

A micro-batch of `rows` sequences cut at width L costs, on one learner rank, per token:
- logits: the local vocabulary slice (vocab / TP) in the model's dtype, its fp32 copy divided by
  the temperature, and the cross entropy's fp32 temporaries (softmax, gradient): about
  `local_vocab x (elem + 12)` bytes;
- activations kept for the backward (Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", per layer and token with tensor parallelism): `hidden x (10 + 24/TP)`
  bytes at 2-byte activations (scaled by elem / 2), plus `5 x heads x L / TP` for the attention
  scores when attention is not fused (megatron's local layer spec; Transformer Engine's flash
  attention keeps none).

CPU keeps a fixed logits budget (`LOGITS_BUDGET` fp32 logits elements per micro-batch in
qurl/learner/megatron.py: 256 MiB). On a GPU the budget is a share (`GPU_FRACTION`) of the memory
free at the moment the batch is split — what the driver reports free plus what torch's caching
allocator holds unused — so a 141 GB GPU packs many 8k-token sequences per pass where the fixed
budget gave one, and a nearly full one falls back to one row per micro-batch (never zero).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GPU_FRACTION = 0.8  # of the free memory: the rest absorbs allocator fragmentation and estimate error


@dataclass(frozen=True)
class TokenCost:
    """What one token of a micro-batch costs on one learner rank (module docstring)."""

    local_vocab: int  # vocab rows on this rank (padded vocab / TP)
    layers: int
    hidden: int
    heads: int
    tp: int
    elem: int  # bytes of the model's compute dtype (2 for bf16, 4 for fp32)
    fused_attention: bool  # Transformer Engine: no [heads, L, L] scores kept

    def bytes(self, L: int) -> float:
        """Bytes per token of a training micro-batch of width L (forward kept for backward)."""
        logits = self.local_vocab * (self.elem + 12)
        act = self.layers * self.hidden * (10 + 24 / self.tp) * self.elem / 2
        scores = 0.0 if self.fused_attention else \
            self.layers * 5 * self.heads * L / self.tp * self.elem / 2
        return logits + act + scores


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on `device` can still get: the driver's free memory plus what
    torch's caching allocator reserved but does not use. None on CPU (no budget to measure)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def rows_per_micro(L: int, cost: TokenCost, free: int | None, cpu_budget: int) -> int:
    """Sequences of width L per micro-batch (>= 1): on CPU (free None) `cpu_budget` fp32 logits
    elements; on GPU GPU_FRACTION of `free` bytes over L x cost.bytes(L)."""
    L = max(1, L)
    if free is None:
        return max(1, cpu_budget // (L * max(1, cost.local_vocab)))
    return max(1, int(free * GPU_FRACTION // (L * cost.bytes(L))))
