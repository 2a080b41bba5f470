"""qurl.research.studies.mismatch: closed-form per-token statistics of ρ = π_prox/π_behav and their buckets."""
import math

import pytest
import torch

from qurl.research.studies.mismatch import _bucket_of, analyse, bucketed, response_positions, summary


def _batch():
    # row 0: prompt 2, response 3 tokens; row 1: prompt 1, response 4 tokens; T = 5
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    prompt_len = torch.tensor([2, 1])
    prox = torch.log(torch.tensor([[0.5, 0.5, 0.9, 0.05, 1.0], [0.5, 0.2, 0.6, 0.995, 0.3]]))
    d = torch.tensor([[9.0, 9.0, 1.0, -0.5, 0.0], [9.0, 0.1, -2.0, 0.2, 0.05]])  # log ρ; 9 on prompts
    behav = prox - d
    return prox, behav, mask, prompt_len, d


def test_summary_closed_form():
    prox, behav, mask, _, d = _batch()
    adv = torch.tensor([1.0, -1.0])
    s = summary(prox, behav, mask, adv, cap=2.0)
    dv = d[mask].double()
    k3 = torch.expm1(dv) - dv
    assert s["tokens"] == 7
    assert s["kl_mean"] == pytest.approx(float(k3.mean()), rel=1e-6)
    assert s["kl_p99"] == pytest.approx(float(torch.quantile(k3, 0.99)), rel=1e-6)  # fp32 logps
    assert s["rho_max"] == pytest.approx(math.e, rel=1e-6)  # the prompts' 9 never counts
    assert s["trunc_frac"] == pytest.approx(1 / 7)  # only log ρ = 1 > log 2
    assert s["acr_widened_frac"] == pytest.approx(1 / 7)  # and its row has A > 0
    assert s["rho_low_frac"] == pytest.approx(1 / 7)  # log ρ = -2 < -log 2
    assert s["kl_k1"] == pytest.approx(float((-dv).mean()), rel=1e-6)
    s2 = summary(prox, behav, mask, -adv, cap=2.0)
    assert s2["acr_widened_frac"] == 0.0 and s2["trunc_frac"] == pytest.approx(1 / 7)


def test_positions_and_buckets():
    prox, behav, mask, prompt_len, d = _batch()
    pos = response_positions(mask, prompt_len)
    assert pos[mask].tolist() == [0, 1, 2, 0, 1, 2, 3]
    rows = bucketed(prox, behav, mask, pos, (0, 2, 4))
    k3 = lambda x: math.expm1(x) - x  # noqa: E731
    first = [1.0, -0.5, 0.1, -2.0]  # positions 0, 1 of both rows
    assert rows[0]["tokens"] == 4 and rows[1]["tokens"] == 3
    assert rows[0]["kl_mean"] == pytest.approx(sum(map(k3, first)) / 4, rel=1e-6)
    total = sum(k3(x) for x in d[mask].tolist())
    assert rows[0]["kl_share"] + rows[1]["kl_share"] == pytest.approx(1.0)
    assert rows[0]["kl_share"] == pytest.approx(sum(map(k3, first)) / total, rel=1e-6)
    assert rows[0]["trunc_frac"] == pytest.approx(1 / 4) and rows[1]["trunc_frac"] == 0.0


def test_probability_buckets_close_the_last_edge():
    vals = torch.tensor([0.0, 0.005, 0.01, 0.99, 1.0, 1.5], dtype=torch.float64)
    assert _bucket_of(vals, (0.0, 0.01, 0.99, 1.0)).tolist() == [0, 0, 1, 2, 2, -1]
    prox, behav, mask, prompt_len, _ = _batch()
    out = analyse(prox, behav, mask, torch.tensor([1.0, 1.0]), prompt_len)
    by_prob = out["by_prob"]
    assert sum(r["tokens"] for r in by_prob) == 7  # p = 1.0 lands in the last bucket
    assert by_prob[-1]["tokens"] == 2  # 0.995 and 1.0
    empty = [r for r in by_prob if r["tokens"] == 0]
    assert all(math.isnan(r["kl_mean"]) for r in empty)


def test_prompt_columns_must_not_be_marked():
    mask = torch.tensor([[1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="before its row's prompt"):
        response_positions(mask, torch.tensor([1]))


def test_report_replaces_only_its_block():
    from qurl.research.studies.mismatch_report import replace_block

    page = "# T\n\n## Rollout speed\n\nspeed text\n"
    once = replace_block(page, "uaq", "table 1")
    assert once.startswith(page.rstrip()) and "## UAQ on this model" in once
    twice = replace_block(once + "\nafter\n", "uaq", "table 2")
    assert "table 1" not in twice and "table 2" in twice
    assert "speed text" in twice and twice.rstrip().endswith("after")
    assert twice.count("## UAQ on this model") == 1


def test_boundary_counts_by_hand():
    from qurl.research.studies.grid_ties import boundary_counts

    # row absmax 127 -> scale 1: boundaries at k + 0.5
    w = torch.tensor([[127.0, 0.5, 2.5, 3.4, 1.0 + 1e-3], [0.0, 0.0, 0.0, 0.0, 0.0]])
    c = boundary_counts(w, [0.01, 0.2])
    assert c["elements"] == 10 and c["ties"] == 2  # 0.5 and 2.5; the zero row has none
    assert c["within:0.01"] == 2 and c["within:0.2"] == 3  # + 3.4 (0.1 from 3.5)


def test_read_uaq_keeps_the_latest_row(tmp_path):
    import json

    from qurl.research.studies.mismatch_report import read_uaq, uaq_block

    rows = [{"kind": "flip", "s": 1.0, "lr": 1e-6, "step": 1, "rows": 2, "grad_norm": 1.0,
             "int8/flip_frac": 0.5},
            {"kind": "flip", "s": 1.0, "lr": 1e-6, "step": 1, "rows": 2, "grad_norm": 1.0,
             "int8/flip_frac": 0.25},
            {"kind": "invariance", "s": 1.5, "max_abs_dlogit": 1e-4, "mean_abs_dlogit": 1e-5,
             "max_abs_logit": 30.0, "positions": 10}]
    f = tmp_path / "u.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = read_uaq(f)
    assert len(res["flips"]) == 1 and res["flips"][0]["int8/flip_frac"] == 0.25
    text = uaq_block(res)
    assert "| 25% |" in text and "| 1e-06 | 1 |" in text and "0.0001" in text
