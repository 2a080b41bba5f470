"""Where the rollout/learner mismatch sits: per-token statistics of ρ = π_prox/π_behav on a batch.

Each token t of a response was sampled by the rollout engine's policy π_behav (8-bit, or the
engine's own full precision) and is scored again by the learner's π_prox. Per token, with
log ρ = prox_logp − behav_logp:

- k3 = ρ − 1 − log ρ ≥ 0, whose mean over tokens sampled from π_behav is KL(π_behav ‖ π_prox)
  (the estimator of qurl.algo.stats); its mean and 99th percentile over tokens;
- max ρ; the share truncated by TIS at C (ρ > C), and the share ACR widens (A > 0 and ρ > C),
  both from qurl.algo.loss.policy_loss's own statistics (preset "acr", evaluated at π_θ = π_prox);
- the same split by the token's position in the response (`POSITION_EDGES`) and by the token's
  probability under π_prox (`PROB_EDGES`): each bucket's share of tokens, its KL mean, its share
  of the batch's total KL (where the mismatch sits) and its share of ρ > C.

Buckets are half-open [lo, hi) except the last, which includes its upper edge (p = 1). Pure tensors
in, floats out; masked tokens never enter a statistic.
"""
from __future__ import annotations

import torch

from qurl.algo.loss import policy_loss
from qurl.algo.stats import ratio_stats

POSITION_EDGES: tuple[int, ...] = (0, 8, 16, 32, 64, 128)
PROB_EDGES: tuple[float, ...] = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)


def k3_per_token(prox_logp: torch.Tensor, behav_logp: torch.Tensor) -> torch.Tensor:
    """ρ − 1 − log ρ per token in float64 (≥ 0). prox_logp, behav_logp: [B, T] -> [B, T]."""
    log_is = prox_logp.double() - behav_logp.double()
    return torch.expm1(log_is) - log_is


def response_positions(mask: torch.Tensor, prompt_len: torch.Tensor) -> torch.Tensor:
    """Index within its response of every column: [B, T] int64 (column j − prompt_len[row]).

    mask: [B, T] bool (True on response columns); prompt_len: [B]. Checks that each row's first
    response column is its prompt length (the layout of qurl.train.batch)."""
    B, T = mask.shape
    pos = torch.arange(T).unsqueeze(0) - prompt_len.view(B, 1)
    if bool((mask & (pos < 0)).any()):
        raise ValueError("a response column lies before its row's prompt length")
    return pos


def summary(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
            adv: torch.Tensor, cap: float = 2.0) -> dict[str, float]:
    """Headline statistics of one arm. prox_logp, behav_logp: [B, T]; mask: [B, T] bool; adv: [B].

    Keys: tokens, kl_mean, kl_p99, rho_max, trunc_frac (ρ > cap), acr_widened_frac (A > 0 and
    ρ > cap), rho_low_frac (ρ < 1/cap), kl_k1 (mean behav − prox, the plain estimator)."""
    m = mask.bool()
    if not bool(m.any()):
        raise ValueError("summary: mask has no valid tokens")
    _, st = policy_loss(prox_logp.float(), prox_logp.float(), behav_logp.float(), adv.float(), m,
                        preset="acr", tis_cap=cap)
    k3 = k3_per_token(prox_logp, behav_logp)[m]
    log_is = (prox_logp.double() - behav_logp.double())[m]
    return {"tokens": st["tokens"], "kl_mean": st["kl_behav_prox"],
            "kl_p99": float(torch.quantile(k3, 0.99)), "rho_max": st["is_ratio_max"],
            "trunc_frac": st["tis_trunc_frac"], "acr_widened_frac": st["acr_widened_frac"],
            "rho_low_frac": float((log_is < -torch.log(torch.tensor(cap, dtype=torch.float64)))
                                  .double().mean()),
            "kl_k1": float((-log_is).mean())}


def _bucket_of(values: torch.Tensor, edges: tuple[float, ...]) -> torch.Tensor:
    """Bucket index per value: i with edges[i] <= v < edges[i+1]; the last bucket closed; -1 outside."""
    e = torch.tensor(edges, dtype=torch.float64)
    idx = torch.bucketize(values.double(), e, right=True) - 1
    idx = torch.where(values.double() == e[-1], torch.full_like(idx, len(edges) - 2), idx)
    return torch.where((idx < 0) | (idx > len(edges) - 2), torch.full_like(idx, -1), idx)


def bucketed(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
             key: torch.Tensor, edges: tuple[float, ...], cap: float = 2.0) -> list[dict[str, float]]:
    """Statistics per bucket of `key` ([B, T], e.g. response position or π_prox probability).

    One dict per bucket [edges[i], edges[i+1]): lo, hi, tokens, token_share, kl_mean (NaN when the
    bucket is empty), kl_share (its share of the batch's summed k3), trunc_frac (share of its
    tokens with ρ > cap), rho_max (NaN when empty). Valid tokens outside every bucket are counted
    in no bucket (token shares then sum to less than 1)."""
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        raise ValueError("bucketed: mask has no valid tokens")
    k3 = k3_per_token(prox_logp, behav_logp)
    total = float(k3[m].sum())
    b = _bucket_of(key, edges)
    log_is = prox_logp.double() - behav_logp.double()
    out = []
    for i in range(len(edges) - 1):
        sel = m & (b == i)
        c = int(sel.sum())
        row = {"lo": float(edges[i]), "hi": float(edges[i + 1]), "tokens": float(c),
               "token_share": c / n, "kl_mean": float("nan"), "kl_share": 0.0,
               "trunc_frac": float("nan"), "rho_max": float("nan")}
        if c:
            rs = ratio_stats(prox_logp, behav_logp, sel)
            row.update(kl_mean=rs["kl_behav_prox"], rho_max=rs["is_ratio_max"],
                       kl_share=float(k3[sel].sum()) / total if total > 0 else float("nan"),
                       trunc_frac=float((log_is[sel] > torch.log(torch.tensor(cap, dtype=torch.float64)))
                                        .double().mean()))
        out.append(row)
    return out


def analyse(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
            adv: torch.Tensor, prompt_len: torch.Tensor, cap: float = 2.0) -> dict:
    """summary + by_position + by_prob (see the module docstring) of one arm."""
    pos = response_positions(mask.bool(), prompt_len)
    prob = torch.exp(prox_logp.double())
    return {"summary": summary(prox_logp, behav_logp, mask, adv, cap),
            "by_position": bucketed(prox_logp, behav_logp, mask, pos, POSITION_EDGES, cap),
            "by_prob": bucketed(prox_logp, behav_logp, mask, prob, PROB_EDGES, cap)}
