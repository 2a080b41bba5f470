"""Core attention that keeps no [heads, L, L] matrix: megatron's local spec on torch SDPA.

megatron-core's local layer spec computes attention unfused (`DotProductAttention`): the scores
`Q Kᵀ` of every head are materialised as a [b·heads, L, L] tensor, softmaxed, and the probabilities
kept for the backward. Per layer and row that is `heads/TP × L² × (2 + 4)` bytes — quadratic in the
length. At the paper's lengths it is the whole budget: Qwen2.5-1.5B at TP 2 and 8,704 tokens keeps
~64 GB of scores per row, more than an 80 GB GPU holds besides everything else.

`torch.nn.functional.scaled_dot_product_attention` computes the same function tile by tile
(FlashAttention: an online softmax over key blocks) and keeps only Q, K, V, the output and one
log-sum-exp per query for the backward — linear in L. On CUDA it dispatches to the flash or the
memory-efficient kernel, on CPU to a fused flash kernel. One condition keeps it there: **no explicit
mask**. An explicit boolean or additive mask sends SDPA to its math fallback, which builds the
scores again. qurl's rows are `prompt ++ response`, right-padded, so plain causal attention is
exact: a padding column comes after every real token of its row and causality never lets it reach
one. Hence `is_causal=True` and `attention_mask` ignored (the learner passes None).

Short bf16 rows on CPU. On CPUs without native bf16 (this project's AMD EPYC machines) the CPU
flash kernel in bf16 is slow on short rows: at the default run's shape (64 rows of 44 tokens, 8
heads of 32) a forward + backward took 31 ms against 12 ms for SDPA's math kernel; the two cross
near 160 positions and at 512 flash is 3.5x faster (fp32: flash is faster at every length). So on
CPU, bf16 rows shorter than `CPU_BF16_MATH_BELOW` positions are computed directly (`_short`: bf16
scores, fp32 softmax, as megatron's unfused path does, 6 ms there), their [heads, L, L] scores at
most 8 x 160² values a row; every other case runs a fused kernel, and a call that no fused kernel
takes fails instead of falling back to the math kernel. (`qurl bench learner --attention`
measures the default run's step both ways.)

Grouped-query attention: K and V have `groups` heads; each is repeated `heads/groups` times (what
megatron's unfused path does too) before the kernel — O(L) memory, and every backend accepts it.

Differences from `DotProductAttention`, refused in the constructor rather than computed wrong:
sliding windows, softmax offsets ('off-by-one', 'learnable'), context parallelism, packed sequences
and attention bias. Dropout is supported (under megatron's RNG tracker, as there) but RL policies
load with attention_dropout = 0.

Transformer Engine's attention is the choice when TE imports (build.py); this module
replaces only the local spec's core attention.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel

CPU_BF16_MATH_BELOW = 160  # positions (module docstring: measured crossover on a 2-core EPYC)


def _short_cpu_bf16(q: torch.Tensor) -> bool:
    """q: [b, heads, s, d]. True where the math kernel is the faster one (module docstring)."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[2] < CPU_BF16_MATH_BELOW


def _backends(q: torch.Tensor) -> list[SDPBackend]:
    """The fused kernels only (no math fallback), but for short CPU bf16 rows with dropout."""
    if _short_cpu_bf16(q):
        return [SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


_CAUSAL: dict[tuple[int, str], torch.Tensor] = {}  # [s, s] bool masks of short rows, by length


def _short(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention computed directly: q, k, v [b, heads, s, d] -> [b, heads, s, d]."""
    s = q.shape[2]
    key = (s, str(q.device))
    if key not in _CAUSAL:
        _CAUSAL[key] = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1)
    scores = torch.baddbmm(q.new_empty(()), q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2),
                           beta=0.0, alpha=scale).view(*q.shape[:3], s).float()
    probs = scores.masked_fill_(_CAUSAL[key], float("-inf")).softmax(-1).to(q.dtype)
    return torch.matmul(probs, v)


class SDPAttention(MegatronModule):
    """Drop-in core attention for megatron's local spec (same constructor and forward signature as
    megatron.core.transformer.dot_product_attention.DotProductAttention), causal, no L×L tensor."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention: context parallelism is not supported")
        if config.window_size is not None:
            raise ValueError("SDPAttention: sliding-window attention is not supported")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SDPAttention: softmax_type={config.softmax_type!r} is not supported")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        head_dim = config.kv_channels
        # megatron's apply_query_key_layer_scaling divides the scale by the layer number and the
        # softmax multiplies it back: the effective scale is softmax_scale (or 1/sqrt(head_dim)).
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None
                ) -> torch.Tensor:
        """query: [s, b, heads, d]; key, value: [s, b, groups, d] (this TP rank's heads) ->
        [s, b, heads·d]. Causal; `attention_mask` is ignored (module docstring)."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention: packed sequences and attention bias are not supported")
        rep = self.heads // self.groups
        if rep > 1:
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        p = self.dropout if self.training else 0.0
        if _short_cpu_bf16(q) and p == 0:
            out = _short(q, k, v, self.scale)
        elif p > 0:  # dropout draws from megatron's tracked RNG, as DotProductAttention's does
            with tensor_parallel.get_cuda_rng_tracker().fork(), sdpa_kernel(_backends(q)):
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                     scale=self.scale)
        else:
            with sdpa_kernel(_backends(q)):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads·d]
