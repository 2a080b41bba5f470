"""Group advantages (GRPO / Dr.GRPO), uniform-group detection and DAPO overlong shaping."""

from __future__ import annotations

import statistics

import pytest
import torch

from qurl.algo.advantages import grpo_advantages, overlong_penalty, uniform_groups


def test_grpo_matches_per_group_reference() -> None:
    # groups interleaved, non-contiguous ids, one uniform group and one singleton
    rewards = torch.tensor([1.0, 0.0, 5.0, 1.0, 0.0, 2.0, 2.0, 7.0, 0.5])
    groups = torch.tensor([10, 10, -3, 10, 10, 4, 4, 99, -3])
    adv = grpo_advantages(rewards, groups, eps=1e-6)
    assert adv.dtype == torch.float32 and adv.shape == rewards.shape
    for g in set(groups.tolist()):
        idx = [i for i, x in enumerate(groups.tolist()) if x == g]
        vals = [float(rewards[i]) for i in idx]
        mu = statistics.fmean(vals)
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0  # Bessel-corrected sample std
        for i in idx:
            assert float(adv[i]) == pytest.approx((float(rewards[i]) - mu) / (sd + 1e-6), rel=1e-6, abs=1e-7)
    # group 10: rewards 1,0,1,0 -> mean 0.5, sample std = sqrt(1/3)
    assert float(adv[0]) == pytest.approx(0.5 / (1 / 3) ** 0.5, rel=1e-5)
    assert float(adv[5]) == 0.0 and float(adv[6]) == 0.0  # uniform group: no signal
    assert float(adv[7]) == 0.0  # singleton: no NaN
    assert bool(torch.isfinite(adv).all())


def test_dr_grpo_is_mean_centred_only() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = grpo_advantages(rewards, groups, scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 1.0, -1.0]))
    # group sums are zero in both variants
    for scale in (True, False):
        a = grpo_advantages(rewards, groups, scale_by_std=scale)
        assert abs(float(a[:4].sum())) < 1e-6 and abs(float(a[4:].sum())) < 1e-6


def test_uniform_groups() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3, 0.3, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3])
    assert uniform_groups(rewards, groups).tolist() == [True, True, False, False, True, True, True, True]


def test_overlong_penalty_dapo_ramp() -> None:
    # max_len 20, buffer 4: free up to 16, linear to -penalty at 20, flat after
    lengths = torch.tensor([0, 16, 17, 18, 20, 21, 1000])
    got = overlong_penalty(lengths, max_len=20, buffer_len=4, penalty=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5, -0.5]))
    assert bool((overlong_penalty(lengths, max_len=20, buffer_len=20) <= 0).all())


def test_bad_input_raises() -> None:
    r, g = torch.ones(4), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(r, g[:3])
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(r, g.float())
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(r.view(2, 2), g.view(2, 2))
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages(torch.tensor([1.0, float("nan"), 0.0, 0.0]), g)
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(r, g, eps=0.0)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=11)
    with pytest.raises(ValueError, match="lengths"):
        overlong_penalty(torch.tensor([-1]), max_len=10, buffer_len=2)
    with pytest.raises(ValueError, match="penalty"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=2, penalty=-1.0)
