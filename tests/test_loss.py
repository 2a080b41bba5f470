"""policy_loss: the hand-worked ACR example, preset equivalences, an independent float64 reference
for value and gradient, aggregation, masking, KL, diagnostics and input validation."""

from __future__ import annotations

import math

import pytest
import torch

from qurl.algo.loss import AGGS, PRESETS, aggregate, loss_denominator, policy_loss


def _one_token(ratio_is: float, r_policy: float, preset: str, adv: float = 1.0):
    """One token with π_prox/π_behav = ratio_is and π_θ/π_prox = r_policy; returns (loss, grad, stats)."""
    behav = torch.tensor([[-2.0]])
    prox = behav + math.log(ratio_is)
    logp = (prox + math.log(r_policy)).clone().requires_grad_(True)
    loss, stats = policy_loss(logp, prox, behav, torch.tensor([adv]), torch.ones(1, 1), preset=preset,
                              eps_low=0.2, eps_high=0.2, tis_cap=2.0)  # fmt: skip
    loss.backward()
    return float(loss.detach()), float(logp.grad[0, 0]), stats


def test_worked_example_tis_vs_acr() -> None:
    # ρ = 5 > C = 2: w = 2, r = C/ρ = 0.4, ACR upper bound (1+0.2)/0.4 = 3.0
    loss, grad, st = _one_token(5.0, 1.5, "tis")
    assert -loss == pytest.approx(2.4, rel=1e-6)  # 2 · min(1.5, 1.2)
    assert grad == 0.0  # clipped: no gradient
    assert st["clip_frac_high"] == 1.0 and st["tis_trunc_frac"] == 1.0 and st["acr_widened_frac"] == 0.0
    assert st["is_ratio_max"] == pytest.approx(5.0, rel=1e-6)

    loss, grad, st = _one_token(5.0, 1.5, "acr")
    assert -loss == pytest.approx(3.0, rel=1e-6)  # 2 · 1.5, inside the widened range
    assert -grad == pytest.approx(3.0, rel=1e-6)  # d/dlogp (w·R·A) = w·R·A = 3.0
    assert st["clip_frac_high"] == 0.0 and st["acr_widened_frac"] == 1.0 and st["tis_trunc_frac"] == 1.0

    loss, grad, st = _one_token(5.0, 3.5, "acr")
    assert -loss == pytest.approx(6.0, rel=1e-6)  # 2 · min(3.5, 3.0)
    assert grad == 0.0
    assert st["clip_frac_high"] == 1.0


def test_worked_example_other_presets() -> None:
    # decoupled: w = ρ = 5, min(1.5, 1.2) -> 6.0, clipped
    loss, grad, _ = _one_token(5.0, 1.5, "decoupled")
    assert -loss == pytest.approx(6.0, rel=1e-6) and grad == 0.0
    # naive: ratio over π_behav = 5 · 1.5 = 7.5 -> clipped at 1.2, no weight
    loss, grad, st = _one_token(5.0, 1.5, "naive")
    assert -loss == pytest.approx(1.2, rel=1e-6) and grad == 0.0
    assert st["tis_trunc_frac"] == 0.0 and st["is_ratio_mean"] == pytest.approx(5.0, rel=1e-6)
    # ppo (standard PPO, paper Eq 1): ratio over the learner's π_prox = 1.5, clipped at 1.2, no
    # weight; the engine's π_behav (here 5x off) does not enter the loss at all
    loss, grad, st = _one_token(5.0, 1.5, "ppo")
    assert -loss == pytest.approx(1.2, rel=1e-6) and grad == 0.0
    assert st["tis_trunc_frac"] == 0.0 and st["is_ratio_mean"] == pytest.approx(5.0, rel=1e-6)
    loss, grad, _ = _one_token(5.0, 1.1, "ppo")
    assert -loss == pytest.approx(1.1, rel=1e-6) and -grad == pytest.approx(1.1, rel=1e-6)
    # inside the clip range every preset has gradient w·R·A
    # (ρ = 1.5; for naive π_θ/π_behav = 1.1, for the others π_θ/π_prox = 1.1)
    for preset, w in (("naive", 1.0), ("ppo", 1.0), ("decoupled", 1.5), ("tis", 1.5), ("acr", 1.5)):
        loss, grad, _ = _one_token(1.5, 1.1 / 1.5 if preset == "naive" else 1.1, preset)
        assert -loss == pytest.approx(w * 1.1, rel=1e-6) and -grad == pytest.approx(w * 1.1, rel=1e-6)
    # A < 0: the lower bound 0.8 binds below, the unclipped term above
    loss, grad, st = _one_token(1.0, 0.5, "acr", adv=-1.0)
    assert -loss == pytest.approx(-0.8, rel=1e-6) and grad == 0.0 and st["clip_frac_low"] == 1.0
    loss, grad, _ = _one_token(1.0, 1.5, "acr", adv=-1.0)
    assert -loss == pytest.approx(-1.5, rel=1e-6) and -grad == pytest.approx(-1.5, rel=1e-6)


def _ref_weight(preset, rho, rhos, cap, corr):
    """The IS weight of one token (ratio rho) in a sequence whose valid tokens have ratios rhos,
    straight from DESIGN.md §1 (float64, products and means taken directly, not in log space)."""
    c = {"icepop_low": 0.5, "icepop_high": 5.0, "icepop_keep": "rho", "seq_tis_cap": 2.0,
         "geo_mask_low": 0.99, "geo_mask_high": 1.01, "geo_mask_keep": "one", **(corr or {})}
    if preset in ("ppo", "naive"):
        return 1.0
    if preset == "decoupled":
        return rho
    if preset in ("tis", "acr"):
        return min(rho, cap)
    if preset == "icepop":
        keep = c["icepop_low"] <= rho <= c["icepop_high"]
        return (rho if c["icepop_keep"] == "rho" else 1.0) if keep else 0.0
    if preset == "mis":
        return rho if rho <= cap else 0.0
    if preset == "seqtis":
        return min(math.prod(rhos), c["seq_tis_cap"])
    assert preset == "geomask"
    g = math.prod(rhos) ** (1 / len(rhos))
    if not c["geo_mask_low"] <= g <= c["geo_mask_high"]:
        return 0.0
    return {"one": 1.0, "rho": rho, "geo": g}[c["geo_mask_keep"]]


def _reference(logp, prox, behav, adv, mask, preset, el, eh, cap, agg, norm_len=None, corr=None):
    """Per-token float64 loop straight from the DESIGN.md table: (loss, dloss/dlogp)."""
    B, T = len(logp), len(logp[0])
    obj = [[0.0] * T for _ in range(B)]
    dobj = [[0.0] * T for _ in range(B)]
    for i in range(B):
        rhos = [math.exp(prox[i][t] - behav[i][t]) for t in range(T) if mask[i][t]]
        for t in range(T):
            if not mask[i][t]:
                continue
            rho = math.exp(prox[i][t] - behav[i][t])
            den = behav[i][t] if preset == "naive" else prox[i][t]
            R = math.exp(logp[i][t] - den)
            w = _ref_weight(preset, rho, rhos, cap, corr)
            U = (1 + eh) / min(1.0, cap / rho) if preset == "acr" else 1 + eh
            A = adv[i][t]
            obj[i][t] = w * min(R * A, min(max(R, 1 - el), U) * A)
            active = not ((A > 0 and R > U) or (A < 0 and R < 1 - el))
            dobj[i][t] = w * R * A if active else 0.0
    n = [sum(row) for row in mask]
    if agg == "token-mean":
        scale = [[1.0 / sum(n)] * T for _ in range(B)]
    elif agg == "seq-mean-token-mean":
        ns = sum(1 for k in n if k > 0)
        scale = [[1.0 / (max(n[i], 1) * ns)] * T for i in range(B)]
    else:
        scale = [[1.0 / ((norm_len or T) * B)] * T for _ in range(B)]
    loss = -sum(obj[i][t] * scale[i][t] for i in range(B) for t in range(T))
    grad = [[-dobj[i][t] * scale[i][t] for t in range(T)] for i in range(B)]
    return loss, torch.tensor(grad, dtype=torch.float64)


def _batch(seed: int, B: int = 4, T: int = 7, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(B, T, generator=g) * 3 - 0.1
    prox = behav + torch.randn(B, T, generator=g) * spread
    logp = prox + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = True
    mask[1, :] = False  # a sequence with no valid token
    mask[1, 0] = True
    return logp, prox, behav, adv, mask


# bounds wide enough that the random batch (log ρ ~ N(0, 1)) has tokens and sequences on both sides
CORR_CASES = [("icepop", {}), ("icepop", {"icepop_low": 0.7, "icepop_high": 1.5, "icepop_keep": "one"}),
              ("mis", {}), ("seqtis", {"seq_tis_cap": 1.5}),
              ("geomask", {"geo_mask_low": 0.6, "geo_mask_high": 1.6}),
              ("geomask", {"geo_mask_low": 0.6, "geo_mask_high": 1.6, "geo_mask_keep": "rho"}),
              ("geomask", {"geo_mask_low": 0.6, "geo_mask_high": 1.6, "geo_mask_keep": "geo"})]


@pytest.mark.parametrize("preset,corr", [(p, {}) for p in PRESETS] + CORR_CASES)
@pytest.mark.parametrize("agg", AGGS)
def test_matches_float64_reference(preset: str, corr: dict, agg: str) -> None:
    logp, prox, behav, adv, mask = _batch(10 * PRESETS.index(preset) + AGGS.index(agg))
    lp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, prox, behav, adv, mask, preset=preset, agg=agg, eps_low=0.2,
                          eps_high=0.28, **corr)
    loss.backward()
    ref_loss, ref_grad = _reference(logp.double().tolist(), prox.double().tolist(), behav.double().tolist(),
                                    adv.tolist(), mask.tolist(), preset, 0.2, 0.28, 2.0, agg,
                                    corr=corr)  # fmt: skip
    assert float(loss.detach()) == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(lp.grad.double(), ref_grad, rtol=1e-5, atol=1e-7)


def test_ppo_equals_tis_when_ratios_are_one() -> None:
    logp, _, behav, adv, mask = _batch(1)
    results = []
    for preset in PRESETS:
        lp = logp.clone().requires_grad_(True)
        loss, st = policy_loss(lp, behav.clone(), behav, adv, mask, preset=preset)
        loss.backward()
        results.append((loss.detach(), lp.grad.clone()))
        assert st["is_ratio_max"] == 1.0 and st["kl_behav_prox"] == 0.0
    for loss, grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(grad, results[0][1], rtol=0, atol=0)


def _loss_and_grad(preset, logp, prox, behav, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    loss, st = policy_loss(lp, prox, behav, adv, mask, preset=preset, **kw)
    loss.backward()
    return loss.detach(), lp.grad, st


def test_tis_equals_acr_when_no_truncation() -> None:
    logp, prox, behav, adv, mask = _batch(2, spread=2.0)
    prox = torch.minimum(prox, behav + math.log(2.0) - 1e-3)  # every ρ ≤ C
    lt, gt, st = _loss_and_grad("tis", logp, prox, behav, adv, mask)
    la, ga, sa = _loss_and_grad("acr", logp, prox, behav, adv, mask)
    assert st["tis_trunc_frac"] == 0.0 and sa["acr_widened_frac"] == 0.0
    torch.testing.assert_close(la, lt, rtol=0, atol=0)
    torch.testing.assert_close(ga, gt, rtol=0, atol=0)


def test_negative_advantages_identical_under_tis_and_acr() -> None:
    logp, prox, behav, adv, mask = _batch(3, spread=3.0)
    adv = -adv.abs() - 0.01
    logp = prox + torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp)  # R over both clip sides
    lt, gt, st = _loss_and_grad("tis", logp, prox, behav, adv, mask)
    la, ga, sa = _loss_and_grad("acr", logp, prox, behav, adv, mask)
    assert st["tis_trunc_frac"] > 0.2 and sa["acr_widened_frac"] == 0.0  # truncation did happen
    torch.testing.assert_close(la, lt, rtol=0, atol=0)
    torch.testing.assert_close(ga, gt, rtol=0, atol=0)


@pytest.mark.parametrize("preset", PRESETS)
def test_masked_tokens_contribute_nothing(preset: str) -> None:
    logp, prox, behav, adv, mask = _batch(4)
    mask[:, -2:] = False
    l0, g0, s0 = _loss_and_grad(preset, logp, prox, behav, adv, mask)
    # garbage (NaN, huge) in padding changes nothing and its gradient is exactly 0
    for t in (logp, prox, behav, adv):
        t[:, -2:] = float("nan")
    prox[:, -1] = 1e6
    l1, g1, s1 = _loss_and_grad(preset, logp, prox, behav, adv, mask)
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    assert bool((g1[:, -2:] == 0).all()) and bool(torch.isfinite(g1).all())
    torch.testing.assert_close(g1, g0, rtol=0, atol=0)
    assert s1 == s0
    # and equal to the batch with the padding cut off
    l2, _, _ = _loss_and_grad(preset, logp[:, :-2], prox[:, :-2], behav[:, :-2], adv[:, :-2], mask[:, :-2])
    torch.testing.assert_close(l2, l0, rtol=1e-6, atol=1e-7)  # only the summation order differs


def test_aggregations_closed_form() -> None:
    # surrogate = A per token (R = 1, ppo); seq 0 has 1 valid token (A=2), seq 1 has 3 (A=-1)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    adv = torch.tensor([2.0, -1.0])
    logp = torch.full((2, 4), -1.0)
    def f(agg, **kw):
        return float(policy_loss(logp, logp, logp, adv, mask, preset="ppo", agg=agg, **kw)[0])
    assert f("token-mean") == pytest.approx(-(2 - 3) / 4)
    assert f("seq-mean-token-mean") == pytest.approx(-(2 + -1) / 2)
    assert f("seq-mean-token-sum-norm") == pytest.approx(-(2 / 4 - 3 / 4) / 2)
    assert f("seq-mean-token-sum-norm", norm_len=8) == pytest.approx(-(2 / 8 - 3 / 8) / 2)
    assert loss_denominator(mask, "token-mean") == 4 and loss_denominator(mask, "seq-mean-token-mean") == 2


@pytest.mark.parametrize("agg", AGGS)
def test_microbatches_with_global_denominator_sum_to_full_loss(agg: str) -> None:
    logp, prox, behav, adv, mask = _batch(5, B=6)
    full, _ = policy_loss(logp, prox, behav, adv, mask, agg=agg, norm_len=9)
    halves = [slice(0, 2), slice(2, 6)]
    denom = sum(loss_denominator(mask[s], agg) for s in halves)
    parts = [policy_loss(logp[s], prox[s], behav[s], adv[s], mask[s], agg=agg, norm_len=9, denom=denom)[0]
             for s in halves]  # fmt: skip
    torch.testing.assert_close(sum(parts), full, rtol=1e-6, atol=1e-7)
    empty = torch.zeros_like(mask)
    loss, st = policy_loss(logp.requires_grad_(True), prox, behav, adv, empty, agg=agg, denom=3.0)
    assert float(loss.detach()) == 0.0 and st == {"loss": 0.0, "tokens": 0.0}
    loss.backward()
    assert bool((logp.grad == 0).all())


def test_kl_to_reference_k3() -> None:
    logp, prox, behav, adv, mask = _batch(6)
    ref = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(0))
    l0, g0, _ = _loss_and_grad("acr", logp, prox, behav, adv, mask)
    l1, g1, st = _loss_and_grad("acr", logp, prox, behav, adv, mask, ref_logp=ref, kl_coef=0.1)
    d = (ref - logp).double()
    k3 = (d.exp() - d - 1)[mask]
    assert st["kl_ref"] == pytest.approx(float(k3.mean()), rel=1e-5)
    assert float(l1 - l0) == pytest.approx(0.1 * float(k3.mean()), rel=1e-4)
    dk = torch.where(mask, (1 - d.exp()) / mask.sum(), torch.zeros_like(d))  # d/dlogp of token-mean k3
    torch.testing.assert_close((g1 - g0).double(), 0.1 * dk, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("preset", PRESETS)
def test_gradient_only_through_logp(preset: str) -> None:
    logp, prox, behav, adv, mask = _batch(7)
    prox.requires_grad_(True)
    behav.requires_grad_(True)
    adv.requires_grad_(True)
    lp = logp.clone().requires_grad_(True)
    policy_loss(lp, prox, behav, adv, mask, preset=preset)[0].backward()
    assert prox.grad is None and behav.grad is None and adv.grad is None and lp.grad is not None


def test_ratio_stats_and_staleness_buckets() -> None:
    behav = torch.zeros(1, 5)
    log_rho = torch.tensor([[0.0, math.log(2.0), math.log(0.5), math.log(4.0), 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    stale = torch.tensor([[0, 0, 1, 1, 5]])  # the ≥2 bucket only holds a masked token
    _, st = policy_loss(behav, behav + log_rho, behav, torch.ones(1), mask, preset="tis", staleness=stale)
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    assert st["is_ratio_mean"] == pytest.approx((1 + 2 + 0.5 + 4) / 4)
    assert st["is_ratio_max"] == pytest.approx(4.0)
    assert st["kl_behav_prox"] == pytest.approx((k3(1) + k3(2) + k3(0.5) + k3(4)) / 4)
    assert st["tis_trunc_frac"] == pytest.approx(0.25)
    assert st["is_ratio_mean/s0"] == pytest.approx(1.5) and st["tokens/s0"] == 2.0
    assert st["is_ratio_max/s1"] == pytest.approx(4.0) and st["kl_behav_prox/s1"] == pytest.approx((k3(0.5) + k3(4)) / 2)
    assert not any(k.endswith("/s2plus") for k in st)
    # huge real ratios are reported at their size while the loss stays finite
    mask[0, 4] = 1
    for preset in ("decoupled", "tis", "acr"):
        lp = behav.clone().requires_grad_(True)
        loss, st = policy_loss(lp, behav + log_rho, behav, torch.ones(1), mask, preset=preset, staleness=stale)
        loss.backward()
        assert math.isfinite(float(loss.detach())) and bool(torch.isfinite(lp.grad).all())
        assert st["is_ratio_max"] == pytest.approx(math.exp(100.0), rel=1e-9)
        assert st["is_ratio_max/s2plus"] == pytest.approx(math.exp(100.0), rel=1e-9)


def test_kl_behav_prox_estimates_the_true_kl() -> None:
    # tokens sampled from π_behav: the k3 mean must converge to KL(behav ‖ prox), not KL(prox ‖ behav)
    g = torch.Generator().manual_seed(8)
    behav_p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    prox_p = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)  # KL(b‖p) ≈ 0.373, KL(p‖b) ≈ 0.422
    tok = torch.multinomial(behav_p, 40000, replacement=True, generator=g)
    b, p = behav_p.log()[tok].view(1, -1), prox_p.log()[tok].view(1, -1)
    _, st = policy_loss(p, p, b, torch.ones(1), torch.ones_like(b), preset="decoupled")
    kl_bp = float((behav_p * (behav_p / prox_p).log()).sum())
    kl_pb = float((prox_p * (prox_p / behav_p).log()).sum())
    assert abs(kl_bp - kl_pb) > 0.1 * kl_bp  # the test can tell the two directions apart
    # standard error of the 40k-sample mean is ≈ 0.7% of kl_bp
    assert st["kl_behav_prox"] == pytest.approx(kl_bp, rel=0.03)


def test_bad_input_raises() -> None:
    logp, prox, behav, adv, mask = _batch(9)
    ok = dict(logp=logp, prox_logp=prox, behav_logp=behav, adv=adv, mask=mask)
    cases = [
        ({"behav_logp": behav[:, :-1]}, {}, "behav_logp"),
        ({"mask": mask[:2]}, {}, "mask"),
        ({"adv": adv[:, :3]}, {}, "adv"),
        ({"logp": logp[0]}, {}, "logp"),
        ({"prox_logp": None}, {"preset": "acr"}, "prox_logp"),
        ({}, {"eps_low": 0.0}, "eps_low"),
        ({}, {"eps_low": 1.0}, "eps_low"),
        ({}, {"eps_high": -0.1}, "eps_high"),
        ({}, {"tis_cap": 0.5}, "tis_cap"),
        ({}, {"seq_tis_cap": 0.5}, "seq_tis_cap"),
        ({}, {"icepop_low": 1.5}, "icepop"),
        ({}, {"geo_mask_high": 0.9}, "geo_mask"),
        ({}, {"icepop_keep": "g"}, "icepop_keep"),
        ({}, {"geo_mask_keep": "two"}, "geo_mask_keep"),
        ({}, {"preset": "grpo"}, "preset"),
        ({}, {"agg": "sum"}, "agg"),
        ({}, {"kl_coef": 0.1}, "ref_logp"),
        ({}, {"kl_coef": -1.0, "ref_logp": logp}, "kl_coef"),
        ({}, {"norm_len": 0}, "norm_len"),
        ({}, {"staleness": -torch.ones(4, dtype=torch.long)}, "staleness"),
        ({}, {"staleness": torch.ones(3, dtype=torch.long)}, "staleness"),
        ({"mask": torch.zeros_like(mask)}, {}, "no valid tokens"),
        ({"mask": mask.float() * 0.5}, {}, "mask"),
    ]
    for override, kw, match in cases:
        args = {**ok, **override}
        with pytest.raises(ValueError, match=match):
            policy_loss(args["logp"], args["prox_logp"], args["behav_logp"], args["adv"], args["mask"], **kw)
    with pytest.raises(ValueError, match="agg"):
        aggregate(logp, mask, "mean")
