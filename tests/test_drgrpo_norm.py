"""Dr.GRPO's `seq-mean-token-sum-norm` in the learner: each sequence's token sum is divided by a
constant (the generation budget), so the loss and its gradient do not depend on how the learner
groups rows into length-sorted micro-batches (one row each here vs the whole mini-batch at once).

Closed form at the first mini-batch (R = 1, `ppo`, w = 1): loss = −Σ_i A_i·n_i / (B·N), with n_i
the valid tokens of row i and N = norm_len.
"""
from __future__ import annotations

import pytest
import torch

from qurl.config import AlgoConfig

NORM_LEN = 16
ALGO = AlgoConfig(loss="ppo", agg="seq-mean-token-sum-norm", mini_batches=1, uaq_scale=1.0)


def _one_step(learner, batch: dict) -> tuple[float, list[torch.Tensor], dict]:
    """Run one step; return (sum of the backpropagated micro-batch losses, gradients, stats)."""
    import qurl.learner.megatron as lm

    losses: list[float] = []
    grads: list[torch.Tensor] = []
    real_loss, real_step = lm.policy_loss, learner.optimizer.step

    def spy_loss(*a, **kw):
        loss, stats = real_loss(*a, **kw)
        if loss.requires_grad:
            losses.append(float(loss.detach()))
        return loss, stats

    def spy_step(max_norm: float) -> float:
        grads.extend(p.grad.detach().clone() for _, p in learner.named_params)
        return real_step(max_norm)

    lm.policy_loss, learner.optimizer.step = spy_loss, spy_step
    try:
        stats = learner.train_step(batch["tokens"], batch["loss_mask"], batch["behav_logp"],
                                   batch["adv"])
    finally:
        lm.policy_loss = real_loss
    return sum(losses), grads, stats


def _worker(rank: int, ws: int) -> dict:
    from test_learner import _batch, _learner
    from tiny_hf import build

    import qurl.learner.megatron as lm
    from qurl.config import LearnerConfig
    from qurl.learner.dist import init_learner_dist

    init_learner_dist(LearnerConfig(tp=1), rank, ws)
    torch.set_num_threads(1)
    batch = _batch(build("qwen2"), seed=7)
    out = {"batch": batch}
    out["whole"] = _one_step(_learner("qwen2", 1, algo=ALGO, norm_len=NORM_LEN), batch)
    budget, lm.LOGITS_BUDGET = lm.LOGITS_BUDGET, 1  # one row (cut at its own end) per micro-batch
    try:
        out["per_row"] = _one_step(_learner("qwen2", 1, algo=ALGO, norm_len=NORM_LEN), batch)
    finally:
        lm.LOGITS_BUDGET = budget
    try:
        _learner("qwen2", 1, algo=ALGO).train_step(batch["tokens"], batch["loss_mask"],
                                                   batch["behav_logp"], batch["adv"])
        out["no_norm_len_error"] = ""
    except ValueError as e:
        out["no_norm_len_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def res() -> dict:
    from qurl.learner.dist import spawn

    return spawn(_worker, 1)[0]


@pytest.mark.slow
def test_loss_and_grads_do_not_depend_on_micro_batch_split(res) -> None:
    (loss_w, grads_w, stats_w), (loss_r, grads_r, stats_r) = res["whole"], res["per_row"]
    b = res["batch"]
    n = b["loss_mask"].sum(dim=1).double()
    ref = -float((b["adv"].double() * n).sum()) / (len(n) * NORM_LEN)  # float64 closed form
    assert loss_w == pytest.approx(ref, rel=1e-5)
    assert loss_r == pytest.approx(ref, rel=1e-5)
    assert stats_w["loss"] == pytest.approx(ref, rel=1e-5)
    assert stats_r["loss"] == pytest.approx(ref, rel=1e-5)
    assert len(grads_w) == len(grads_r) > 0
    for gw, gr in zip(grads_w, grads_r):
        torch.testing.assert_close(gr, gw, rtol=1e-4, atol=1e-7)
    assert stats_r["grad_norm"] == pytest.approx(stats_w["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_sum_norm_without_a_constant_is_refused(res) -> None:
    assert "norm_len" in res["no_norm_len_error"]

