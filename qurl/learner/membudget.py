"""What a learner rank holds: a cost model of its memory, and the micro-batch split it implies.

A learner rank holds two kinds of memory:

- **fixed** (`fixed_bytes`), per parameter on this rank (P = the rank's TP shard): the model's
  weights (elem bytes), their gradients (elem), fp32 master weights (4) and AdamW's two fp32 moments
  (8; both divided by DP with deploy.ranks.distributed_optimizer), and the optimizer step's flat fp32
  gradient (4);
- **per micro-batch** (`TokenCost.forward_bytes`, `micro_bytes`): what the forward keeps for the
  backward, plus the largest transient. With megatron's local spec and `e` bytes per activation
  (h hidden, d head_dim, q = heads·d, kv = groups·d, f ffn, t TP), one layer keeps per token (read
  off autograd's saved tensors, fp32, Qwen2.5-1.5B shapes):
    - the two RMSNorms' inputs and outputs: `4h·e` (and one fp32 rstd each);
    - RoPE's cos and sin for q and k: `4d·e`;
    - attention, `"flash"` (torch SDPA, attention.py, or TE): the RoPE'd Q, K and V
      repeated to every head, the output and its reshaped copy for the output projection
      (`5q/t·e`) and one fp32 log-sum-exp per head (`4·heads/t`) — nothing that grows with L;
      `"unfused"` (megatron's DotProductAttention): Q, K, V, output and copy (`5q/t·e`) plus the
      softmax probabilities, `heads/t × L` per token, in fp32 and again in the model's dtype when
      that is bf16; and one layer's scores in megatron's reused matmul buffer (a transient);
    - the MLP: FC1's output (`2f`), SiLU's input half, its output and the product (`3f`): `5f/t·e`.
  With recompute (learner.recompute; megatron-core's own) less is kept and one layer's worth is
  rebuilt during the backward:
    - "full": each layer keeps only its input (`h·e`); one layer's activations live at a time;
    - "selective" (core attention + MLP recomputed): a layer keeps its input, its norms, RoPE,
      the RoPE'd Q and K, the fused QKV output V is a view of, the attention output and the
      projection input (`(5h + 4d)·e + (4q + 3kv)/t·e`, read off autograd's saved tensors).
  Under recompute a layer's forward still builds its intermediates, then drops them: at the
  forward's peak one MLP's (`5f/t·e`, measured for both "selective" and "full") sits on top of
  what is kept — or the head's chunk, whichever is larger (they never coincide). Outside the layers the final norm keeps `2h·e`. The head runs in chunks of positions
  (logits.py) and holds one chunk of logits at a time: in the forward its product and
  fp32 scaled copy (8 bytes per logit), in the backward also the softmax and its gradient
  (`e + 12`).

The model was checked against measured peaks (`qurl bench learner --memory`, a fresh process per
point, on CPU in fp32 with Qwen2.5-1.5B's layer shapes and vocabulary cut to two layers): see
docs/long_sequences.md for the table and its reading.

The split (`rows_per_micro`): on CPU a fixed logits budget (LOGITS_BUDGET fp32 logits per
micro-batch in megatron.py); on a GPU a share (`GPU_FRACTION`) of the memory free when
the batch is split — what the driver reports free plus what torch's caching allocator holds unused.
Every learner rank must run the same number of micro-batches (the TP all-reduces inside a forward
pair up rank by rank), so the free figure is agreed before the split: the minimum over all learner
ranks (`agreed_free`, one all-reduce), never one rank's own reading.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

GPU_FRACTION = 0.8  # of the free memory: the rest absorbs allocator fragmentation and estimate error


@dataclass(frozen=True)
class TokenCost:
    """What a micro-batch costs on one learner rank (module docstring)."""

    local_vocab: int  # vocab rows on this rank (padded vocab / TP)
    layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    ffn: int
    tp: int
    elem: int  # bytes of the model's compute dtype (2 for bf16, 4 for fp32)
    attention: str = "flash"  # "flash" (SDPA / TE: nothing L x L kept) or "unfused"
    recompute: str = "none"  # learner.recompute: none | selective | full
    chunk_logits: int = 2**26  # logits per head chunk (logits.py LOGITS_CHUNK)

    def _layer(self, L: int) -> float:
        """Bytes per token one layer keeps without recompute."""
        e, t = self.elem, self.tp
        q = self.heads * self.head_dim
        common = (4 * self.hidden + 4 * self.head_dim + 5 * q / t + 5 * self.ffn / t) * e
        if self.attention == "flash":
            return common + 4 * self.heads / t
        return common + self.heads / t * L * self._probs_bytes()

    def _probs_bytes(self) -> int:
        """Bytes per unfused attention probability kept: fp32 softmax, and its cast when bf16."""
        return 4 + (self.elem if self.elem != 4 else 0)

    def token_bytes(self, L: int) -> float:
        """Bytes per token of a micro-batch of width L kept for the backward (all layers)."""
        e, t = self.elem, self.tp
        if self.recompute == "full":
            kept = self.hidden * e
        elif self.recompute == "selective":
            kv = self.groups * self.head_dim
            q = self.heads * self.head_dim
            kept = (5 * self.hidden + 4 * self.head_dim) * e + (4 * q + 3 * kv) / t * e
        else:
            kept = self._layer(L)
        return self.layers * kept + 2 * self.hidden * e

    def _scores_buffer(self, tokens: int, L: int) -> float:
        """megatron's unfused attention computes one layer's scores into a reused buffer."""
        return 0.0 if self.attention == "flash" else self.heads / self.tp * L * tokens * self.elem

    def _forward_transient(self) -> float:
        """Bytes per token that exist only while one layer's forward runs under recompute: its
        MLP's intermediates (FC1's output, SiLU's input half, output and product: the `5f/t·e`
        a layer keeps without recompute); none without recompute (everything is kept)."""
        return 0.0 if self.recompute == "none" else 5 * self.ffn / self.tp * self.elem

    def forward_bytes(self, rows: int, L: int) -> float:
        """Peak bytes of a training micro-batch's forward (`rows` rows of width L): what it keeps
        for the backward plus the larger of two transients that never coincide — one chunk of
        logits in the head (its model-dtype product and fp32 scaled copy: at most 8 bytes per
        logit) and, under recompute, one layer's forward intermediates."""
        tokens = rows * L
        chunk = min(tokens * self.local_vocab, self.chunk_logits) * 8
        return tokens * self.token_bytes(L) + self._scores_buffer(tokens, L) + \
            max(chunk, tokens * self._forward_transient())

    def micro_bytes(self, rows: int, L: int) -> float:
        """Bytes to plan for a training micro-batch of `rows` rows of width L (its backward's
        bound): what the forward keeps, one layer rebuilt under recompute, one chunk of logits in
        the backward (product, fp32 copies, softmax and its gradient: `elem + 12` bytes per
        logit)."""
        tokens = rows * L
        recomputed = 0.0 if self.recompute == "none" else self._layer(L) * tokens
        chunk = min(tokens * self.local_vocab, self.chunk_logits) * (self.elem + 12)
        return tokens * self.token_bytes(L) + self._scores_buffer(tokens, L) + recomputed + chunk


def grad_bytes(params: int, elem: int, tied_head: int = 0) -> float:
    """Bytes of the gradients a backward makes: one per parameter of this rank in the model's dtype,
    and for a tied head (`tied_head` = V_local x h elements) a second one for the head's use of the
    embedding, summed into the first only at the end of the backward."""
    return (params + tied_head) * elem


def fixed_bytes(params: int, elem: int, dp: int, distributed: bool) -> float:
    """Bytes a rank holds whatever the batch: weights and gradients (elem each), fp32 masters,
    AdamW moments (DP-sharded when `distributed`) and the step's flat fp32 gradient."""
    return params * (2 * elem + 4 + 8 / (dp if distributed else 1) + 4)


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on `device` can still get: the driver's free memory plus what
    torch's caching allocator reserved but does not use. None on CPU (no budget to measure)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def agreed_free(free: int | None, device: torch.device) -> int | None:
    """The minimum of `free` over every learner rank (an all-reduce on the default group when
    torch.distributed is up; None stays None only when every rank has None)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return free
    t = torch.tensor([-1 if free is None else free], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return None if int(t) < 0 else int(t)


def rows_per_micro(L: int, cost: TokenCost, free: int | None, cpu_budget: int) -> int:
    """Sequences of width L per micro-batch (>= 1): on CPU (free None) `cpu_budget` fp32 logits
    elements; on GPU the most rows whose `micro_bytes` fit GPU_FRACTION of `free`."""
    L = max(1, L)
    if free is None:
        return max(1, cpu_budget // (L * max(1, cost.local_vocab)))
    budget = free * GPU_FRACTION
    lo, hi = 1, max(1, int(budget // (L * cost.token_bytes(L))) + 1)  # micro_bytes grows with rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost.micro_bytes(mid, L) <= budget else (lo, mid - 1)
    return lo
