"""Group-relative advantages (GRPO, Dr.GRPO) and DAPO reward shaping.

RLVR samples G responses per prompt (a "group") and scores each with a verifiable reward. The
advantage of a response is its reward relative to its group, shared by all its tokens:

- GRPO:    A_i = (r_i − mean_g) / (std_g + eps)
- Dr.GRPO: A_i =  r_i − mean_g            (no std division: it over-weights near-uniform groups)

`std_g` is the sample standard deviation (Bessel-corrected, as torch.std and the GRPO reference
implementations use). A group of one has A = 0 exactly (its mean is its reward), so its undefined
std is never needed. A group whose rewards are all equal gives A = 0 for every member: it carries no
learning signal, which is why DAPO's dynamic sampling drops such groups (`uniform_groups`).

`overlong_penalty` is DAPO's soft overlong punishment: no penalty up to `max_len − buffer_len`
tokens, then a linear ramp to −penalty at `max_len`, and −penalty beyond; it is added to rewards
before the advantages are computed.

Invariants: group ids may be any integers (not necessarily contiguous or sorted); statistics are
computed in float64; NaN/inf rewards are refused, never averaged in.
"""

from __future__ import annotations

import torch


def _check(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids must have the shape of rewards {tuple(rewards.shape)}, got {tuple(group_ids.shape)}")
    if torch.is_floating_point(group_ids) or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if not bool(torch.isfinite(rewards.double()).all()):
        raise ValueError("rewards contain NaN or inf")


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, sample std (0 for singleton groups) and group size, all float64 [N]."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    k = int(inv.max()) + 1 if inv.numel() else 0
    r = rewards.double()
    count = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, inv, r) / count
    dev2 = (r - mean[inv]) ** 2  # two-pass variance: no catastrophic cancellation
    ss = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, inv, dev2)
    std = torch.sqrt(ss / (count - 1).clamp(min=1))
    return mean[inv], std[inv], count[inv]


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages. rewards: [N] float; group_ids: [N] int -> [N] float32.

    scale_by_std=True is GRPO, False is Dr.GRPO (mean-centred only; eps unused then).
    """
    _check(rewards, group_ids)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    mean, std, _ = _group_stats(rewards, group_ids)
    adv = rewards.double() - mean
    if scale_by_std:
        adv = adv / (std + eps)
    return adv.to(torch.float32)


def uniform_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N] bool: True for samples whose group's rewards are all equal (no signal; DAPO drops them).

    A group of one is uniform too.
    """
    _check(rewards, group_ids)
    _, inv = torch.unique(group_ids, return_inverse=True)
    k = int(inv.max()) + 1 if inv.numel() else 0
    r = rewards.double()
    hi = torch.full((k,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, inv, r, "amax")
    lo = torch.full((k,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, inv, r, "amin")
    return (hi == lo)[inv]


def overlong_penalty(
    lengths: torch.Tensor, *, max_len: int, buffer_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment. lengths: [N] response token counts -> [N] float32, in [−penalty, 0].

    0 for length ≤ max_len − buffer_len; (max_len − buffer_len − length) / buffer_len · penalty inside
    the buffer; −penalty past max_len.
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D [N], got shape {tuple(lengths.shape)}")
    if bool((lengths < 0).any()):
        raise ValueError("lengths must be >= 0")
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    if not penalty >= 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    start = max_len - buffer_len
    over = (lengths.double() - start).clamp(min=0, max=buffer_len)
    return (-penalty * over / buffer_len).to(torch.float32)
