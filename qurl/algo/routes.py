"""Route-flip statistics of a Mixture-of-Experts policy: how often the learner's router picks other
experts than the rollout engine's did for the same token (pure tensors in, counts and numbers out).

In a MoE layer each token goes to the k experts its router scores highest. The rollout engine (8-bit
weights, other kernels, maybe an older policy version) and the full-precision learner compute those
scores from slightly different numbers, so near a tie they choose different experts: a *route
flip*. A flip changes which weights process the token, so π_prox and π_behav then differ by far
more than the quantization of one expert would explain (R3, arXiv 2510.11370: ~10% of router
decisions, 94% of tokens flipping in at least one layer, on Qwen3-30B-A3B).

What counts as a flip: the k experts are compared as a *set* (the order of the top-k, which
depends on the scores' ranking inside the set, does not change which experts run; their mixing
weights are recomputed by the learner either way). A (token, layer) pair flips when the learner's
set differs from the engine's in at least one expert.

The statistics are kept as sums (`RouteCounts`) so that micro-batches, mini-batches and
data-parallel ranks add up exactly before the fractions are taken:
- `moe/route_flip_frac`: flipped (token, layer) pairs / (tokens · layers);
- `moe/tokens_any_flip`: tokens with a flip in at least one layer / tokens;
- `moe/worst_layer_flip`, `moe/worst_layer`: the largest per-layer flip fraction and its layer
  (model order, 0-based);
- `moe/expert_load_max_over_mean`: per layer, the busiest expert's token count over the mean count
  (1 = perfectly balanced, E/k = every token on the same k experts), averaged over the layers;
  from the learner's own routing, so it needs no engine routes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def expert_sets(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """idx: [..., k] integer expert ids -> [..., E] bool, True on the chosen experts."""
    out = torch.zeros((*idx.shape[:-1], num_experts), dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, idx.long(), True)


def flips(own: torch.Tensor, engine: torch.Tensor, num_experts: int) -> torch.Tensor:
    """own, engine: [N, L, k] expert ids (learner's, engine's) -> [N, L] bool: True where the two
    top-k *sets* differ."""
    if own.shape != engine.shape:
        raise ValueError(f"own routes {tuple(own.shape)} vs engine routes {tuple(engine.shape)}")
    return (expert_sets(own, num_experts) != expert_sets(engine, num_experts)).any(-1)


@dataclass
class RouteCounts:
    """Sums behind the moe/ statistics (module docstring). `layer_flips` [L] and `load` [L, E] are
    float64 counts; `tokens` counts the tokens compared with the engine, `load_tokens` those whose
    own routing entered `load`."""

    num_layers: int
    num_experts: int

    def __post_init__(self) -> None:
        self.tokens = 0.0
        self.tokens_any = 0.0
        self.layer_flips = torch.zeros(self.num_layers, dtype=torch.float64)
        self.load = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self.load_tokens = 0.0

    def add(self, own: torch.Tensor, engine: torch.Tensor | None) -> None:
        """own: [N, L, k] the learner's own top-k at N watched tokens; engine: [N, L, k] the
        engine's at the same tokens, or None (then only the expert load is counted)."""
        own = own.detach().cpu()
        self.load += expert_sets(own, self.num_experts).sum(0, dtype=torch.float64)
        self.load_tokens += own.shape[0]
        if engine is None:
            return
        f = flips(own, engine.detach().cpu(), self.num_experts)  # [N, L]
        self.tokens += f.shape[0]
        self.tokens_any += float(f.any(-1).sum())
        self.layer_flips += f.sum(0, dtype=torch.float64)

    def flat(self) -> torch.Tensor:
        """All sums as one float64 vector (for an all-reduce); `load_flat` restores them."""
        head = torch.tensor([self.tokens, self.tokens_any, self.load_tokens], dtype=torch.float64)
        return torch.cat([head, self.layer_flips, self.load.flatten()])

    def load_flat(self, v: torch.Tensor) -> None:
        L, E = self.num_layers, self.num_experts
        self.tokens, self.tokens_any, self.load_tokens = (float(x) for x in v[:3])
        self.layer_flips = v[3:3 + L].clone()
        self.load = v[3 + L:].reshape(L, E).clone()

    def stats(self) -> dict[str, float]:
        """The moe/ record entries (module docstring); flip entries only when tokens were compared
        with the engine, the load only when some were routed."""
        out: dict[str, float] = {}
        if self.tokens:
            per_layer = self.layer_flips / self.tokens
            out["moe/route_flip_frac"] = float(per_layer.mean())
            out["moe/tokens_any_flip"] = self.tokens_any / self.tokens
            worst = int(per_layer.argmax())
            out["moe/worst_layer_flip"] = float(per_layer[worst])
            out["moe/worst_layer"] = float(worst)
        if self.load_tokens:
            mean = self.load.mean(-1).clamp(min=1e-12)  # [L]; > 0 when any token was routed
            out["moe/expert_load_max_over_mean"] = float((self.load.max(-1).values / mean).mean())
        return out
