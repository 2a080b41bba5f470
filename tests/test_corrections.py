"""IcePop, masked IS, sequence-level TIS and the geometric sequence mask: hand-worked loss and
gradient on small batches (numbers in the comments), inclusive bounds, NaN padding, the recorded
truncated/masked shares, and the config's fields reaching the loss."""
from __future__ import annotations

import math

import pytest
import torch

from qurl.algo.loss import loss_options, policy_loss
from qurl.config import load_config

NAN = float("nan")


def _run(rhos, r_policy, adv, mask, preset, **kw):
    """Batch with ρ = π_prox/π_behav = rhos and R = π_θ/π_prox = r_policy (π_behav = 1, so
    log ρ is exact at the bounds). NaN in rhos marks padding: every input there is NaN.
    Returns (loss, dloss/dlogp, stats)."""
    rho = torch.tensor(rhos, dtype=torch.float32)
    pad = torch.isnan(rho)
    behav = torch.where(pad, torch.full_like(rho, NAN), torch.zeros_like(rho))
    prox = torch.log(rho)
    logp = (prox + math.log(r_policy)).requires_grad_(True)
    a = torch.tensor(adv, dtype=torch.float32)
    a = torch.where(pad, torch.full_like(rho, NAN), a[:, None].expand_as(rho))
    opts = {"eps_low": 0.2, "eps_high": 0.2, "tis_cap": 2.0, **kw, "preset": preset}
    loss, st = policy_loss(logp, prox, behav, a, torch.tensor(mask, dtype=torch.bool), **opts)
    loss.backward()
    return float(loss.detach()), logp.grad, st


def _close(grad, expected):
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-7)


def test_icepop_masks_outside_the_bounds_inclusive():
    # ρ = 0.4 (< 0.5: masked), 0.5 and 5 (on the bounds: kept), 2, 6 (> 5: masked), a NaN pad;
    # R = 1.1 inside the clip range, A = 1: kept tokens give w·1.1, gradient −w·R·A/5
    rhos, m = [[0.4, 0.5, 2.0, 5.0, 6.0, NAN]], [[1, 1, 1, 1, 1, 0]]
    loss, grad, st = _run(rhos, 1.1, [1.0], m, "icepop")
    assert loss == pytest.approx(-(0.5 + 2.0 + 5.0) * 1.1 / 5, rel=1e-6)  # −1.65
    _close(grad, [[0.0, -0.11, -0.44, -1.1, 0.0, 0.0]])
    assert (st["mask_frac_low"], st["mask_frac_high"]) == (0.2, 0.2)
    assert st["tis_trunc_frac"] == 0.0
    # SkyRL's choice: kept tokens weigh 1; and narrower bounds [0.45, 4] mask 5 as well
    loss, grad, _ = _run(rhos, 1.1, [1.0], m, "icepop", icepop_keep="one")
    assert loss == pytest.approx(-3 * 1.1 / 5, rel=1e-6)
    _close(grad, [[0.0, -0.22, -0.22, -0.22, 0.0, 0.0]])
    loss, _, st = _run(rhos, 1.1, [1.0], m, "icepop", icepop_low=0.35, icepop_high=4.0)
    assert loss == pytest.approx(-(0.4 + 0.5 + 2.0) * 1.1 / 5, rel=1e-6)
    assert (st["mask_frac_low"], st["mask_frac_high"]) == (0.0, 0.4)


def test_icepop_weight_multiplies_the_clipped_surrogate():
    # ρ = 2 kept, R = 1.5 > 1.2 with A = 1: 2·min(1.5, 1.2) = 2.4, clipped: no gradient;
    # A = −1, R = 1.5: 2·min(−1.5, −1.2) = −3, gradient −(2·1.5·−1)/2 = 1.5 on that token
    loss, grad, st = _run([[2.0], [2.0]], 1.5, [1.0, -1.0], [[1], [1]], "icepop")
    assert loss == pytest.approx(-(2.4 - 3.0) / 2, rel=1e-6)
    _close(grad, [[0.0], [1.5]])
    assert st["clip_frac_high"] == 0.5


def test_masked_is_drops_instead_of_truncating():
    # C = 2: ρ = 0.4 kept with weight 0.4 (one-sided), 2 kept (bound inclusive), 6 dropped;
    # R = 1.1, A = 1: (0.44 + 2.2 + 0)/3; TIS would have given 6 → 2 instead of 0
    rhos, m = [[0.4, 2.0, 6.0, NAN]], [[1, 1, 1, 0]]
    loss, grad, st = _run(rhos, 1.1, [1.0], m, "mis")
    assert loss == pytest.approx(-(0.44 + 2.2) / 3, rel=1e-6)
    _close(grad, [[-0.44 / 3, -2.2 / 3, 0.0, 0.0]])
    assert (st["mask_frac_low"], st["mask_frac_high"], st["tis_trunc_frac"]) == (0.0, 1 / 3, 0.0)
    tis, _, st = _run(rhos, 1.1, [1.0], m, "tis")
    assert tis == pytest.approx(-(0.44 + 2.2 + 2.2) / 3, rel=1e-6) and st["tis_trunc_frac"] == 1 / 3


def test_sequence_tis_weighs_every_token_by_the_truncated_product():
    # seq 0: ρ = 2, 3 (∏ = 6 > C_seq = 2: w = 2 on both), a NaN pad; A = 1
    # seq 1: ρ = 0.5, 1.5, 0.8 (∏ = 0.6: w = 0.6 on all three); A = −1
    # R = 1.1 (inside the clip for both signs): objective (2·2·1.1 − 3·0.6·1.1)/5 = 0.484
    rhos, m = [[2.0, 3.0, NAN], [0.5, 1.5, 0.8]], [[1, 1, 0], [1, 1, 1]]
    loss, grad, st = _run(rhos, 1.1, [1.0, -1.0], m, "seqtis")
    assert loss == pytest.approx(-0.484, rel=1e-5)
    _close(grad, [[-0.44, -0.44, 0.0], [0.132, 0.132, 0.132]])
    assert st["tis_trunc_frac"] == pytest.approx(2 / 5)  # seq 0's tokens
    assert (st["mask_frac_low"], st["mask_frac_high"]) == (0.0, 0.0)
    # C_seq = 8 leaves seq 0 at its product 6
    loss, grad, st = _run(rhos, 1.1, [1.0, -1.0], m, "seqtis", seq_tis_cap=8.0)
    assert loss == pytest.approx(-(2 * 6 * 1.1 - 3 * 0.6 * 1.1) / 5, rel=1e-5)
    assert st["tis_trunc_frac"] == 0.0


def test_sequence_tis_of_a_long_sequence_stays_finite():
    # 400 tokens of ρ = 10: ∏ = 1e400 overflows float64, log space caps it at C_seq = 2
    loss, grad, st = _run([[10.0] * 400], 1.0, [1.0], [[1] * 400], "seqtis")
    assert loss == pytest.approx(-2.0, rel=1e-5) and st["tis_trunc_frac"] == 1.0
    _close(grad, [[-2.0 / 400] * 400])


def test_geometric_mask_keeps_sequences_whose_mean_log_ratio_is_near_zero():
    # g = sqrt(ρ1·ρ2): seq 0 sqrt(1.02) = 1.00995 (kept, in [0.99, 1.01]), seq 1 sqrt(1.05) =
    # 1.0247 (masked high), seq 2 sqrt(0.9) = 0.9487 (masked low); NaN pad; R = 1.1, A = 1
    rhos = [[1.02, 1.0, NAN], [1.05, 1.0, NAN], [0.9, 1.0, NAN]]
    m = [[1, 1, 0]] * 3
    loss, grad, st = _run(rhos, 1.1, [1.0] * 3, m, "geomask")  # kept weight 1 (SkyRL, verl)
    assert loss == pytest.approx(-2 * 1.1 / 6, rel=1e-6)
    _close(grad, [[-1.1 / 6, -1.1 / 6, 0.0], [0.0] * 3, [0.0] * 3])
    assert st["mask_frac_low"] == pytest.approx(1 / 3) and st["mask_frac_high"] == pytest.approx(1 / 3)
    loss, grad, _ = _run(rhos, 1.1, [1.0] * 3, m, "geomask", geo_mask_keep="rho")  # NeMo-RL
    assert loss == pytest.approx(-(1.02 + 1.0) * 1.1 / 6, rel=1e-6)
    _close(grad, [[-1.02 * 1.1 / 6, -1.1 / 6, 0.0], [0.0] * 3, [0.0] * 3])
    loss, _, _ = _run(rhos, 1.1, [1.0] * 3, m, "geomask", geo_mask_keep="geo")  # AReaL, slime
    assert loss == pytest.approx(-2 * math.sqrt(1.02) * 1.1 / 6, rel=1e-6)
    # bounds [0.94, 1.03] hold all three sequences
    loss, _, st = _run(rhos, 1.1, [1.0] * 3, m, "geomask", geo_mask_low=0.94, geo_mask_high=1.03)
    assert loss == pytest.approx(-6 * 1.1 / 6, rel=1e-6)
    assert (st["mask_frac_low"], st["mask_frac_high"]) == (0.0, 0.0)


def test_config_fields_reach_the_loss():
    cfg = load_config(sets=["algo.loss=icepop", "algo.correction.bounds=0.5,3",
                            "algo.correction.keep=one", "algo.correction.cap=5"])
    kw = loss_options(cfg.algo)
    assert (kw["preset"], kw["icepop_high"], kw["icepop_keep"]) == ("icepop", 3.0, "one")
    # one cap for every weight; the other mask keeps its usual bounds and kept weight
    assert (kw["seq_tis_cap"], kw["tis_cap"]) == (5.0, 5.0)
    assert (kw["geo_mask_low"], kw["geo_mask_high"], kw["geo_mask_keep"]) == (0.99, 1.01, "one")
    geo = loss_options(load_config(sets=["algo.loss=geomask", "algo.correction.bounds=0.95,1.05",
                                         "algo.correction.keep=geo"]).algo)
    assert (geo["geo_mask_low"], geo["geo_mask_high"], geo["geo_mask_keep"]) == (0.95, 1.05, "geo")
    assert (geo["icepop_low"], geo["icepop_high"], geo["icepop_keep"]) == (0.5, 5.0, "rho")
    # ρ = 4 is masked with icepop_high = 3 and kept with the default 5
    loss, _, st = _run([[4.0, 1.0]], 1.0, [1.0], [[1, 1]], kw.pop("preset"), **kw)
    assert loss == pytest.approx(-0.5, rel=1e-6) and st["mask_frac_high"] == 0.5


def test_every_run_records_what_each_correction_would_cut():
    # seq 0: ρ = 0.4, 6 (∏ = 2.4, g = 1.549); seq 1: ρ = 1, 1, 1.3 (∏ = 1.3, g = 1.3^(1/3) = 1.091)
    rhos, m = [[0.4, 6.0, NAN], [1.0, 1.0, 1.3]], [[1, 1, 0], [1, 1, 1]]
    _, _, st = _run(rhos, 1.0, [1.0, 1.0], m, "ppo")
    assert st["cut/tis"] == 1 / 5  # 6 > C = 2
    assert st["cut/mis"] == 1 / 5  # the same token, dropped instead
    assert st["cut/icepop"] == 2 / 5  # 0.4 < 0.5 and 6 > 5
    assert st["cut/seqtis"] == 2 / 5  # seq 0: 2.4 > C_seq = 2
    assert st["cut/geomask"] == 1.0  # both g outside [0.99, 1.01]
    assert st["is_weight_mean"] == 1.0 and st["tis_trunc_frac"] == 0.0  # ppo itself cuts nothing
    _, _, st = _run(rhos, 1.0, [1.0, 1.0], m, "seqtis")
    assert st["is_weight_mean"] == pytest.approx((2 * 2 + 3 * 1.3) / 5, rel=1e-6)
    assert st["cut/seqtis"] == st["tis_trunc_frac"] == 2 / 5
    _, _, st = _run(rhos, 1.0, [1.0, 1.0], m, "icepop", icepop_high=8.0)  # bounds apply to cut/ too
    assert st["cut/icepop"] == st["mask_frac_low"] == 1 / 5
