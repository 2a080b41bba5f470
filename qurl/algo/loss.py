"""The clipped policy-gradient surrogate of QuRL and its baselines: one function, nine presets.

Per valid token (A advantage, R = π_θ/π_den, ρ = π_prox/π_behav, ε_lo/ε_hi clip, C cap), the
objective maximised is `w · min(R·A, clip(R, 1−ε_lo, U)·A)` with

| preset      | denominator of R | IS weight w    | upper bound U      |
| ----------- | ---------------- | -------------- | ------------------ |
| `ppo`       | π_prox           | 1              | 1+ε_hi             |
| `naive`     | π_behav          | 1              | 1+ε_hi             |
| `decoupled` | π_prox           | ρ              | 1+ε_hi             |
| `tis`       | π_prox           | min(ρ, C)      | 1+ε_hi             |
| `acr`       | π_prox           | min(ρ, C)      | (1+ε_hi)/r, r = min(1, C/ρ) |
| `icepop`, `mis`, `seqtis`, `geomask` | π_prox | see qurl.algo.corrections | 1+ε_hi |

`ppo` is standard PPO (the paper's Eq 1, verl's default): the denominator is the learner's own
recomputed pre-update policy π_prox and there is no IS weight, so whatever separates the rollout
engine from the learner (kernels, bf16 rounding) never enters the clipping; it is the bf16 baseline.
`naive` is the control of the paper's Eq 3: rollout is quantized yet π_behav is used as the
PPO denominator as if it were the policy, which the paper shows collapses. `decoupled` is
Hilton et al.'s decoupled PPO (AReaL), `tis` caps the weight (FlashRL's truncated IS), and `acr` is
QuRL's Adaptive Clipping Range (Eq 9): when the weight is truncated (ρ > C, so r < 1) the upper clip
is widened so that the bound on π_θ/π_behav for A>0 tokens is again exactly (1+ε_hi), i.e.
w·U = ρ·(1+ε_hi). A<0 tokens only meet the lower clip, so TIS and ACR agree on them. The field's
other corrections — IcePop (token mask outside [α, β]), masked IS (drop ρ > C), sequence-level TIS
(min(∏ρ, C_seq) on the whole sequence) and the geometric sequence mask — are decoupled PPO with
their weight; their equations and the choices where frameworks disagree are in
qurl.algo.corrections.

The loss is the negated objective, aggregated over tokens (`agg`):
- `token-mean` (DAPO): Σ_valid / #valid tokens;
- `seq-mean-token-mean` (GRPO): mean over sequences (with ≥1 valid token) of each one's token mean;
- `seq-mean-token-sum-norm` (Dr.GRPO): mean over the B sequences of token sum / `norm_len` (a
  constant, default T), so long and short answers are not reweighted. The learner passes the
  generation budget (rollout.max_new_tokens): T of a length-cut micro-batch is not a constant.
With micro-batches, pass `denom` = the global count (sum of `loss_denominator` over all
micro-batches) so that summed micro-batch losses equal the loss of the whole batch.

Invariants:
- w and r are computed under no_grad from prox_logp and behav_logp only; the gradient flows only
  through logp (and the optional k3 KL term to `ref_logp`).
- everything is computed in float32; log ratios are clamped before exp (|log R| ≤ 20, log ρ ≤ 50) so
  extreme ratios stay finite, while `is_ratio_max` reports the real, unclamped value.
- masked tokens contribute nothing, to the loss, the gradient or the stats, even if they hold NaN
  (values are selected with `where`, never multiplied by 0). NaN in a valid token propagates.
"""

from __future__ import annotations

from typing import Any

import torch

from qurl.algo.corrections import CUT_PRESETS, PRESETS, Correction, is_weights
from qurl.algo.stats import masked_fraction, ratio_stats

AGGS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_R_CLAMP = 20.0  # |log π_θ/π_den| bound: e^20 ≈ 4.9e8, far past any clip range


def loss_options(algo: Any) -> dict[str, Any]:
    """policy_loss's keyword arguments from an AlgoConfig: preset, clip, caps, bounds, agg, kl."""
    eps_low, eps_high = algo.clip
    return dict(preset=algo.loss, eps_low=eps_low, eps_high=eps_high, agg=algo.agg,
                kl_coef=algo.kl_coef, **vars(Correction.of(algo)))


def loss_denominator(mask: torch.Tensor, agg: str = "token-mean") -> float:
    """What `agg` divides by for this batch: valid tokens, sequences with a valid token, or B.

    mask: [B, T]. Sum it over micro-batches (and data-parallel ranks) and pass it as `denom`.
    """
    _check_agg(agg)
    m = mask.bool()
    if agg == "token-mean":
        return float(m.sum())
    if agg == "seq-mean-token-mean":
        return float(m.any(dim=1).sum())
    return float(m.shape[0])


def aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    *,
    norm_len: int | None = None,
    denom: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values x: [B, T] over valid tokens (mask: [B, T] bool) to a scalar by `agg`."""
    _check_agg(agg)
    m = mask.bool()
    xm = torch.where(m, x, torch.zeros_like(x))
    if denom is None:
        denom = loss_denominator(m, agg)
        if denom == 0:
            raise ValueError("mask has no valid tokens; pass denom to allow an empty micro-batch")
    elif denom <= 0:
        raise ValueError(f"denom must be > 0, got {denom}")
    if agg == "token-mean":
        return xm.sum() / denom
    if agg == "seq-mean-token-mean":
        n = m.sum(dim=1)
        per_seq = xm.sum(dim=1) / n.clamp(min=1)  # rows with n=0 sum to 0 and are not counted
        return per_seq.sum() / denom
    length = x.shape[1] if norm_len is None else norm_len
    return (xm.sum(dim=1) / length).sum() / denom


def _check_agg(agg: str) -> None:
    if agg not in AGGS:
        raise ValueError(f"agg must be one of {AGGS}, got {agg!r}")


def _validate(
    logp: torch.Tensor,
    prox_logp: torch.Tensor | None,
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    preset: str,
    eps_low: float,
    eps_high: float,
    agg: str,
    ref_logp: torch.Tensor | None,
    kl_coef: float,
    staleness: torch.Tensor | None,
    norm_len: int | None,
) -> None:
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    _check_agg(agg)
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    shape = tuple(logp.shape)
    named = {"behav_logp": behav_logp, "mask": mask, "prox_logp": prox_logp, "ref_logp": ref_logp}
    for name, t in named.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have the shape of logp {shape}, got {tuple(t.shape)}")
    if prox_logp is None and preset != "naive":
        raise ValueError(f"prox_logp is required for preset {preset!r}")
    for name, t in (("adv", adv), ("staleness", staleness)):
        if t is not None and tuple(t.shape) not in (shape, shape[:1]):
            raise ValueError(f"{name} must be [B] or [B, T] with {shape}, got {tuple(t.shape)}")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0 and 1")
    if not eps_low > 0 or not eps_low < 1:
        raise ValueError(f"eps_low must be in (0, 1), got {eps_low}")
    if not eps_high > 0:
        raise ValueError(f"eps_high must be > 0, got {eps_high}")
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp")
    if norm_len is not None and norm_len <= 0:
        raise ValueError(f"norm_len must be > 0, got {norm_len}")


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor | None,
    behav_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    preset: str = "acr",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    tis_cap: float = 2.0,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    icepop_keep: str = "rho",
    seq_tis_cap: float = 2.0,
    geo_mask_low: float = 0.99,
    geo_mask_high: float = 1.01,
    geo_mask_keep: str = "one",
    agg: str = "token-mean",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    staleness: torch.Tensor | None = None,
    norm_len: int | None = None,
    denom: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Negated clipped surrogate of `preset` (+ kl_coef · k3 KL to ref_logp), and diagnostics.

    logp: [B, T] log π_θ of the sampled tokens (differentiable); prox_logp: [B, T] log π_prox (may be
    None for `naive` alone, which ignores it in the loss); behav_logp: [B, T] log π_behav from the
    rollout engine; adv: [B] or [B, T]; mask: [B, T], 1/True for response tokens; ref_logp: [B, T];
    staleness: [B] or [B, T] int versions behind (for stats only). `denom`: see `loss_denominator`.

    icepop_low/high, icepop_keep, seq_tis_cap, geo_mask_low/high, geo_mask_keep: the other
    corrections' bounds and choices (qurl.algo.corrections; `loss_options` reads them from the config).

    Stats (floats, fractions over valid tokens): loss, tokens, clip_frac_low (A<0 and R<1−ε_lo: the
    lower clip cuts the gradient), clip_frac_high (A>0 and R>U), tis_trunc_frac (weight truncated at
    its cap: ρ>C under tis/acr, ∏ρ>C_seq under seqtis, else 0), acr_widened_frac (A>0 and ρ>C under
    acr, else 0), mask_frac_low/high (weight zeroed below/above the bounds under icepop, mis,
    geomask, else 0), is_weight_mean (mean IS weight w), cut/<c> for c in tis, icepop, mis, seqtis, geomask (the share of tokens
    correction c, with these bounds, would truncate or mask on this batch, whatever the preset: how
    hard each correction bites on an arm's own rollouts), is_ratio_mean, is_ratio_max,
    kl_behav_prox (k3, see qurl.algo.stats), kl_ref (token mean, when ref_logp is given), and the
    ratio stats per staleness bucket. For ppo/naive the ratio stats still compare prox_logp (if
    given) with behav_logp: they measure the engine/learner gap the loss ignores. With no valid token
    (allowed only with `denom`) the loss is 0 and stats hold just loss and tokens.
    """
    _validate(logp, prox_logp, behav_logp, adv, mask, preset, eps_low, eps_high, agg,
              ref_logp, kl_coef, staleness, norm_len)  # fmt: skip
    corr = Correction(tis_cap=tis_cap, icepop_low=icepop_low, icepop_high=icepop_high,
                      icepop_keep=icepop_keep, seq_tis_cap=seq_tis_cap, geo_mask_low=geo_mask_low,
                      geo_mask_high=geo_mask_high, geo_mask_keep=geo_mask_keep)
    corr.check()
    m = mask.bool()
    B, T = logp.shape
    lp = logp.float()
    behav = behav_logp.detach().float()
    prox = behav if prox_logp is None else prox_logp.detach().float()
    a = adv.detach().float()
    a = a[:, None].expand(B, T) if a.dim() == 1 else a
    zero = torch.zeros_like(lp)
    a = torch.where(m, a, zero)  # padding may hold anything; keep it out of every product
    st = None
    if staleness is not None:
        st = staleness[:, None].expand(B, T) if staleness.dim() == 1 else staleness
        if bool((m & (st < 0)).any()):
            raise ValueError("staleness must be >= 0 on valid tokens")

    with torch.no_grad():
        log_is = torch.where(m, prox - behav, zero)  # log ρ
        wts = is_weights(log_is, m, preset, corr)
        w = wts.w
        den = behav if preset == "naive" else prox
        upper = torch.full_like(lp, 1.0 + eps_high) / wts.r
        lower = torch.full_like(lp, 1.0 - eps_low)

    log_r = torch.where(m, lp - den, zero).clamp(-LOG_R_CLAMP, LOG_R_CLAMP)
    ratio = torch.exp(log_r)
    clipped = torch.minimum(torch.maximum(ratio, lower), upper)
    surr = w * torch.minimum(ratio * a, clipped * a)
    loss = -aggregate(surr, m, agg, norm_len=norm_len, denom=denom)

    kl_tok = None
    if ref_logp is not None:
        d = torch.where(m, ref_logp.detach().float() - lp, zero).clamp(-LOG_R_CLAMP, LOG_R_CLAMP)
        kl_tok = torch.expm1(d) - d  # k3: e^d − 1 − d ≥ 0, unbiased for KL(π_θ‖π_ref) on π_θ samples
        if kl_coef > 0:
            loss = loss + kl_coef * aggregate(kl_tok, m, agg, norm_len=norm_len, denom=denom)

    stats: dict[str, float] = {"loss": float(loss.detach()), "tokens": float(m.sum())}
    if not bool(m.any()):
        return loss, stats
    with torch.no_grad():
        r_d = ratio.detach()
        stats["clip_frac_low"] = masked_fraction((a < 0) & (r_d < lower), m)
        stats["clip_frac_high"] = masked_fraction((a > 0) & (r_d > upper), m)
        stats["tis_trunc_frac"] = masked_fraction(wts.truncated, m)
        stats["acr_widened_frac"] = masked_fraction(wts.truncated & (a > 0), m) if preset == "acr" else 0.0
        stats["mask_frac_low"] = masked_fraction(wts.masked_low, m)
        stats["mask_frac_high"] = masked_fraction(wts.masked_high, m)
        stats["is_weight_mean"] = float(w[m].double().mean())
        for name in CUT_PRESETS:  # what each correction would cut on these tokens, whatever the preset
            cut = wts if name == preset else is_weights(log_is, m, name, corr)
            stats[f"cut/{name}"] = masked_fraction(cut.truncated | cut.masked_low | cut.masked_high, m)
        if kl_tok is not None:
            stats["kl_ref"] = float(kl_tok.detach()[m].mean())
        stats.update(ratio_stats(prox, behav, m, st))
    return loss, stats
