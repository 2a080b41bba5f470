"""qurl.research.studies.mismatch_exact: exact KL and truncation from full distributions, and the sampled
per-token statistics drawn from them, against closed forms."""
import math

import pytest
import torch

from qurl.research.studies.mismatch_exact import (analyse, exact_kl, exact_trunc, response_rows,
                                         sampled_tokens)


def _pair():
    b = torch.tensor([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]])
    p = torch.tensor([[0.25, 0.5, 0.25], [0.9, 0.05, 0.05]])
    return b.log(), p.log()


def test_exact_kl_and_trunc_closed_form():
    lb, lp = _pair()
    kl = exact_kl(lb, lp)
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.25 * math.log(0.5), rel=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)
    tr = exact_trunc(lb, lp, cap=1.5)  # ρ = 2 on token 1 of row 0, drawn with p_b = 0.25
    assert tr.tolist() == pytest.approx([0.25, 0.0], abs=1e-7)


def test_sampled_tokens_follow_behav():
    lb, lp = _pair()
    behav, prox = sampled_tokens(lb, lp, 20000, seed=1)
    assert behav.shape == (2, 20000)
    share_tok1 = float((behav[0] == math.log(0.25)).float().mean())  # tokens 1 and 2 share p_b
    assert share_tok1 == pytest.approx(0.5, abs=0.02)
    k3 = torch.expm1(prox - behav) - (prox - behav)  # mean k3 under π_b estimates the exact KL
    assert float(k3[0].double().mean()) == pytest.approx(float(exact_kl(lb, lp)[0]), rel=0.1)


def test_analyse_pairs_sides_and_positions():
    ctx = {"tokens": torch.zeros(2, 5, dtype=torch.long),
           "loss_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)}
    assert response_rows(ctx) == [(0, 2, 4), (1, 1, 5)]
    V = 3
    lsm = {"engine:int8": torch.log_softmax(torch.randn(6, V, generator=torch.Generator().manual_seed(0)), -1),
           "learner:float32": torch.log_softmax(torch.zeros(6, V), -1)}
    arms = analyse(ctx, lsm, k=8)
    assert [(a["precision"], a["learner"]) for a in arms] == [("int8", "float32")]
    a = arms[0]
    assert a["positions"] == 6 and a["summary"]["tokens"] == 48
    assert a["kl_exact"] == pytest.approx(float(exact_kl(lsm["engine:int8"], lsm["learner:float32"]).mean()))
    assert [r["tokens"] for r in a["by_position"]][0] == 48  # positions 0..3 all in [0, 8)


def test_analyse_uses_the_rows_every_side_finished():
    ctx = {"tokens": torch.zeros(2, 5, dtype=torch.long),
           "loss_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)}
    g = torch.Generator().manual_seed(1)
    lsm = {"engine:int8": torch.log_softmax(torch.randn(3, 4, generator=g), -1),  # row 0 + 1 of row 1
           "learner:float32": torch.log_softmax(torch.randn(6, 4, generator=g), -1)}
    a = analyse(ctx, lsm, k=4)[0]
    assert a["responses"] == 1 and a["positions"] == 2  # only row 0 is complete on both sides
    assert a["kl_exact"] == pytest.approx(float(exact_kl(lsm["engine:int8"][:2],
                                                         lsm["learner:float32"][:2]).mean()))


def test_analyse_in_chunks_gives_the_same_exact_values(monkeypatch):
    """Positions analysed CHUNK at a time (bounded memory at 256 responses): the exact KL and
    truncation share are those of one block; the sampled statistics keep their token count."""
    import qurl.research.studies.mismatch_exact as mx

    ctx = {"tokens": torch.zeros(3, 6, dtype=torch.long),
           "loss_mask": torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0],
                                      [0, 1, 1, 0, 0, 0]], dtype=torch.bool)}
    g = torch.Generator().manual_seed(2)
    lsm = {"engine:fp8": torch.log_softmax(3 * torch.randn(10, 7, generator=g), -1),
           "learner:float32": torch.log_softmax(3 * torch.randn(10, 7, generator=g), -1)}
    whole = analyse(ctx, lsm, k=5)[0]
    monkeypatch.setattr(mx, "CHUNK", 3)  # 10 positions: blocks of 3, 3, 3, 1
    parts = analyse(ctx, lsm, k=5)[0]
    assert parts["kl_exact"] == pytest.approx(whole["kl_exact"], rel=1e-12)
    assert parts["kl_exact_p99"] == pytest.approx(whole["kl_exact_p99"], rel=1e-12)
    assert parts["trunc_exact"] == pytest.approx(whole["trunc_exact"], rel=1e-12)
    assert parts["trunc_exact"] > 0  # the check is not vacuous
    assert parts["summary"]["tokens"] == whole["summary"]["tokens"] == 50
