"""Diagnostics of the gap between the sampling policy and the proximal policy.

With quantized (and, in async mode, stale) rollout, each token was sampled by `π_behav` while the
learner's full-precision policy at the start of the step is `π_prox`. The per-token importance ratio
`ρ = π_prox / π_behav = exp(prox_logp − behav_logp)` measures the gap. These helpers summarise it over
the valid tokens of a batch:

- `is_ratio_mean`, `is_ratio_max`: mean and max of ρ, computed in float64 from the log ratio, so a
  huge ratio is reported at its real size (inf only past float64's range, ~e^709) and never clipped.
- `kl_behav_prox`: the k3 estimator `ρ − 1 − log ρ` averaged over tokens. Tokens are drawn from
  `π_behav`, so its expectation is exactly KL(π_behav ‖ π_prox); unlike the plain k1 estimator
  `behav_logp − prox_logp` (also unbiased) every term is ≥ 0 and its variance is lower when the two
  policies are close, which is the regime of 8-bit rollout.
- `tokens`: the count of valid tokens (so callers can weight averages across micro-batches).

Split by staleness (versions between the policy that sampled a token and the learner's): keys get the
suffix `/s0`, `/s1`, `/s2plus`; a bucket with no valid token is omitted rather than reported as NaN.

Invariant: masked tokens never enter a statistic, whatever values (even NaN) they hold.
"""

from __future__ import annotations

import torch

STALENESS_BUCKETS: tuple[tuple[str, int, int | None], ...] = (("s0", 0, 0), ("s1", 1, 1), ("s2plus", 2, None))


def masked_fraction(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of valid tokens (mask True) where `flags` is True. flags, mask: [B, T] bool."""
    n = int(mask.sum())
    if n == 0:
        raise ValueError("masked_fraction: mask has no valid tokens")
    return int((flags & mask).sum()) / n


def _ratio_summary(log_is: torch.Tensor) -> dict[str, float]:
    """Summary of a 1-D tensor of valid-token log ratios (float64)."""
    rho = torch.exp(log_is)
    k3 = torch.expm1(log_is) - log_is  # ρ − 1 − log ρ; expm1 keeps precision when ρ ≈ 1
    return {
        "is_ratio_mean": float(rho.mean()),
        "is_ratio_max": float(torch.exp(log_is.max())),
        "kl_behav_prox": float(k3.mean()),
        "tokens": float(log_is.numel()),
    }


def ratio_stats(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    staleness: torch.Tensor | None = None,
) -> dict[str, float]:
    """Importance-ratio diagnostics over valid tokens, overall and per staleness bucket.

    prox_logp, behav_logp: [B, T]; mask: [B, T] bool (True = valid); staleness: [B, T] int ≥ 0 or None.
    Returns keys is_ratio_mean, is_ratio_max, kl_behav_prox, tokens (and the same with /s0, /s1,
    /s2plus for non-empty buckets when staleness is given). Needs at least one valid token.
    """
    with torch.no_grad():
        log_is = (prox_logp.double() - behav_logp.double())
        if not bool(mask.any()):
            raise ValueError("ratio_stats: mask has no valid tokens")
        out = _ratio_summary(log_is[mask])
        if staleness is not None:
            for key, lo, hi in STALENESS_BUCKETS:
                sel = mask & (staleness >= lo)
                if hi is not None:
                    sel = sel & (staleness <= hi)
                if bool(sel.any()):
                    for k, v in _ratio_summary(log_is[sel]).items():
                        out[f"{k}/{key}"] = v
        return out
