"""Importance weights of the off-policy corrections: what multiplies the clipped PPO surrogate.

Rollout tokens are sampled by π_behav (the quantized, possibly stale engine) while the learner's
pre-update policy is π_prox; per valid token t of sequence i the ratio is
`ρ_t = π_prox/π_behav = exp(prox_logp − behav_logp)`. Every preset here except `ppo`/`naive` is
decoupled PPO: the surrogate `min(R·A, clip(R, 1−ε_lo, U)·A)` with `R = π_θ/π_prox` is computed
first, then multiplied by a weight w (outside the min/clip, as verl, SkyRL, NeMo-RL, AReaL, slime and
TRL all do). The weight is a constant of the update: computed under no_grad from prox_logp and
behav_logp only, never differentiated.

| preset    | weight w_t                                                        | default bounds     |
| --------- | ----------------------------------------------------------------- | ------------------ |
| decoupled | ρ_t                                                               |                    |
| tis       | min(ρ_t, C)                                                       | C = 2              |
| acr       | min(ρ_t, C), and U = (1+ε_hi)/r with r = min(1, C/ρ_t)            | C = 2              |
| icepop    | ρ_t if α ≤ ρ_t ≤ β else 0  (keep="one": 1 instead of ρ_t)         | [α, β] = [0.5, 5]  |
| mis       | ρ_t if ρ_t ≤ C else 0                                             | C = 2              |
| seqtis    | min(∏_t ρ_t, C_seq) = exp(min(Σ_t log ρ_t, log C_seq)), every t   | C_seq = 2          |
| geomask   | k_t if low ≤ g_i ≤ high else 0, g_i = exp(mean_t log ρ_t)         | [0.99, 1.01]       |

(`ppo` and `naive` have w = 1: PPO over π_prox, or over π_behav as if it were the policy.) Products
and means run over the sequence's valid tokens only; they are computed in log space, so a sequence of
a thousand tokens neither overflows nor underflows before the cap. Bounds are inclusive.

Where the sources disagree, the choice made here (DESIGN.md §1 lists the sources):
- IcePop's kept tokens carry ρ_t (verl, NeMo-RL, slime, AReaL; `icepop_keep="rho"`, the default)
  or 1 (SkyRL; `icepop_keep="one"`).
- The geometric mask's kept sequences carry k_t = 1 (SkyRL, verl; `geo_mask_keep="one"`, default),
  ρ_t per token (NeMo-RL; "rho") or g_i on every token (AReaL, slime; "geo").
- Config: one `[algo.correction]` table serves every kind (`Correction.of` reads it): `cap` is C
  and C_seq, `bounds` and `keep` apply to the kind algo.loss names, empty / "auto" = the
  defaults above; every other kind (and its cut/<c> diagnostic) keeps its defaults.
- Masked IS is one-sided (TRL: only ρ > C is dropped). The two-sided variant of verl/slime is
  IcePop with the lower bound set (`icepop`, [α, β]).
- Sequence TIS's cap C_seq is algo.correction.cap like C, 2 by default (verl's; TRL uses
  3, SkyRL 5); it is truncated from above only, so a long sequence with mean log ρ < 0 (on average
  E_behav[log ρ] = −KL(π_behav‖π_prox) per token) gets a weight far below 1 without being "cut":
  `is_weight_mean` shows it.
- A masked token keeps its place in the loss's denominator (token-mean counts it: it contributes
  0 to the sum), as everywhere but verl's `rollout_rs` rejection mode. Dropping it from the
  denominator would make the loss scale depend on how much the correction masks.

Diagnostics (fractions over the valid tokens, recorded per step): `tis_trunc_frac` — tokens whose
weight was truncated at its cap (ρ_t > C for tis/acr; every token of a sequence with ∏ρ > C_seq for
seqtis); `mask_frac_low` / `mask_frac_high` — tokens whose weight was set to 0 because ρ_t (g_i for
geomask) fell below the lower bound / above the upper one (icepop, mis, geomask);
`is_weight_mean` — the mean weight w over valid tokens (1 for ppo/naive); and, on every
preset, `cut/<c>` for c in CUT_PRESETS: the share correction c would truncate or mask on the same
tokens (so a bf16 or ACR run shows how hard IcePop or the geometric mask would bite).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

PRESETS: tuple[str, ...] = ("ppo", "naive", "decoupled", "tis", "acr", "icepop", "mis", "seqtis",
                            "geomask")
CUT_PRESETS: tuple[str, ...] = ("tis", "icepop", "mis", "seqtis", "geomask")  # reported as cut/<c>
ICEPOP_KEEP: tuple[str, ...] = ("rho", "one")
GEO_MASK_KEEP: tuple[str, ...] = ("one", "rho", "geo")
LOG_IS_CLAMP = 50.0  # log ρ bound for untruncated weights (e^50·e^20 fits in fp32)


@dataclass(frozen=True)
class Correction:
    """Bounds and choices of the corrections (the algo config's fields; `of` reads them)."""
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    icepop_keep: str = "rho"
    seq_tis_cap: float = 2.0
    geo_mask_low: float = 0.99
    geo_mask_high: float = 1.01
    geo_mask_keep: str = "one"

    def check(self) -> None:
        """ValueError naming the first bad parameter."""
        if not self.tis_cap >= 1:
            raise ValueError(f"tis_cap (C) must be >= 1, got {self.tis_cap}")
        if not self.seq_tis_cap >= 1:
            raise ValueError(f"seq_tis_cap must be >= 1, got {self.seq_tis_cap}")
        if not 0 < self.icepop_low <= 1 <= self.icepop_high:
            raise ValueError(f"icepop bounds must satisfy 0 < icepop_low <= 1 <= icepop_high, got "
                             f"[{self.icepop_low}, {self.icepop_high}]")
        if not 0 < self.geo_mask_low <= 1 <= self.geo_mask_high:
            raise ValueError(f"geo_mask bounds must satisfy 0 < geo_mask_low <= 1 <= geo_mask_high,"
                             f" got [{self.geo_mask_low}, {self.geo_mask_high}]")
        if self.icepop_keep not in ICEPOP_KEEP:
            raise ValueError(f"icepop_keep must be one of {ICEPOP_KEEP}, got {self.icepop_keep!r}")
        if self.geo_mask_keep not in GEO_MASK_KEEP:
            raise ValueError(f"geo_mask_keep must be one of {GEO_MASK_KEEP}, got "
                             f"{self.geo_mask_keep!r}")

    @classmethod
    def of(cls, algo: Any) -> "Correction":
        """From an AlgoConfig: `algo.correction.cap` is both caps; its `bounds` ((low, high), or
        empty) and `keep` ("auto" or a choice) set the kind `algo.loss` names, the defaults of
        this class stand for empty / "auto" and for the other kind."""
        c, base = algo.correction, cls()
        kw: dict[str, Any] = {"tis_cap": c.cap, "seq_tis_cap": c.cap}
        prefix = {"icepop": "icepop", "geomask": "geo_mask"}.get(algo.loss)
        if prefix is not None:
            low, high = c.bounds or (getattr(base, f"{prefix}_low"), getattr(base, f"{prefix}_high"))
            keep = getattr(base, f"{prefix}_keep") if c.keep == "auto" else c.keep
            kw.update({f"{prefix}_low": low, f"{prefix}_high": high, f"{prefix}_keep": keep})
        return cls(**kw)


@dataclass
class Weights:
    """w: [B, T] IS weight; r: [B, T] ACR's divisor of the upper clip bound (1 elsewhere);
    truncated / masked_low / masked_high: [B, T] bool flags over valid tokens (for the stats)."""
    w: torch.Tensor
    r: torch.Tensor
    truncated: torch.Tensor
    masked_low: torch.Tensor
    masked_high: torch.Tensor


@torch.no_grad()
def is_weights(log_is: torch.Tensor, mask: torch.Tensor, preset: str, c: Correction) -> Weights:
    """The weight of `preset` (module table). log_is: [B, T] float32 log ρ, 0 on masked tokens (the
    caller selects it with `where`, so padding holding NaN never enters); mask: [B, T] bool."""
    ones = torch.ones_like(log_is)
    no = torch.zeros_like(mask)
    out = Weights(ones, ones, no, no, no)
    if preset in ("ppo", "naive"):
        return out
    rho = torch.exp(log_is.clamp(max=LOG_IS_CLAMP))
    zero = torch.zeros_like(log_is)
    if preset == "decoupled":
        out.w = rho
    elif preset in ("tis", "acr"):
        out.w = rho.clamp(max=c.tis_cap)
        out.truncated = mask & (log_is > math.log(c.tis_cap))
        if preset == "acr":
            out.r = (c.tis_cap * torch.exp(-log_is.clamp(max=LOG_IS_CLAMP))).clamp(max=1.0)
    elif preset == "icepop":
        out.masked_low = mask & (log_is < math.log(c.icepop_low))
        out.masked_high = mask & (log_is > math.log(c.icepop_high))
        kept = rho if c.icepop_keep == "rho" else ones
        out.w = torch.where(out.masked_low | out.masked_high, zero, kept)
    elif preset == "mis":
        out.masked_high = mask & (log_is > math.log(c.tis_cap))
        out.w = torch.where(out.masked_high, zero, rho)
    elif preset == "seqtis":
        log_seq = log_is.sum(dim=1, keepdim=True)  # Σ_t log ρ_t over valid tokens: [B, 1]
        log_cap = math.log(c.seq_tis_cap)
        out.w = torch.exp(log_seq.clamp(max=log_cap)).expand_as(log_is)
        out.truncated = mask & (log_seq > log_cap)
    elif preset == "geomask":
        n = mask.sum(dim=1, keepdim=True).clamp(min=1)
        log_g = log_is.sum(dim=1, keepdim=True) / n  # [B, 1]; a row with no valid token: g = 1
        out.masked_low = mask & (log_g < math.log(c.geo_mask_low))
        out.masked_high = mask & (log_g > math.log(c.geo_mask_high))
        kept = {"one": ones, "rho": rho, "geo": torch.exp(log_g).expand_as(log_is)}[c.geo_mask_keep]
        out.w = torch.where(out.masked_low | out.masked_high, zero, kept)
    else:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    return out
