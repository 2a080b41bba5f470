"""qurl.research.studies.mask_bias: kept shares and advantage balance on hand-worked batches, and the sampled
batch's log ρ aligned with what the engines score token by token."""
from __future__ import annotations

import json
import math

import pytest
import torch

from qurl.algo.corrections import Correction
from qurl.config import load_config
from qurl.engines.local import LocalEngine
from qurl.models.hf import build_model
from qurl.research.studies.mask_bias import by_kind, main, mask_profile, sample_batch

MICRO = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128}


def _batch():
    """A right answer (A = +1, 2 tokens, log ρ 0), a wrong one the engine over-rates (A = −1,
    2 tokens, log ρ −0.1) and a long wrong one (A = −1, 4 tokens, log ρ +0.001)."""
    log_is = torch.tensor([[0.0, 0.0, 0.0, 0.0], [-0.1, -0.1, 0.0, 0.0], [1e-3] * 4])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    return log_is, mask, torch.tensor([1.0, -1.0, -1.0]), torch.tensor([True, False, False])


def test_mask_profile_hand_worked():
    out = mask_profile(*_batch(), Correction(), presets=("none", "geomask", "tis"))
    # |A| mass: 2 + 2 + 4 = 8 tokens of |A| = 1
    assert out["none"] == pytest.approx({"kept_right": 1, "kept_wrong": 1, "push": (2 - 2 - 4) / 8,
                                         "kept_adv": 1}, abs=1e-12)
    # g = e^-0.1 < 0.99 drops the short wrong answer; e^0.001 is inside [0.99, 1.01]
    assert out["geomask"] == pytest.approx({"kept_right": 1, "kept_wrong": 4 / 6,
                                            "push": (2 - 4) / 8, "kept_adv": 6 / 8}, abs=1e-12)
    w1, w2 = math.exp(-0.1), math.exp(1e-3)  # TIS at C = 2 truncates nothing here: w = ρ
    assert out["tis"]["push"] == pytest.approx((2 - 2 * w1 - 4 * w2) / 8, rel=1e-6)
    assert out["tis"]["kept_adv"] == pytest.approx((2 + 2 * w1 + 4 * w2) / 8, rel=1e-6)


def test_mask_profile_empty_kind_is_nan_and_shapes_checked():
    log_is, mask, adv, _ = _batch()
    out = mask_profile(log_is, mask, adv, torch.zeros(3, dtype=torch.bool), Correction(), ("none",))
    assert math.isnan(out["none"]["kept_right"]) and out["none"]["kept_wrong"] == 1.0
    with pytest.raises(ValueError, match="shapes"):
        mask_profile(log_is, mask[:, :3], adv, torch.ones(3, dtype=torch.bool), Correction())


def test_by_kind_hand_worked():
    log_is, mask, _, right = _batch()
    out = by_kind(log_is, mask, right)
    assert out["right"] == pytest.approx({"answers": 1, "mean_log_rho": 0.0, "length": 2.0})
    assert out["wrong"] == pytest.approx({"answers": 2, "mean_log_rho": (-0.1 + 1e-3) / 2,
                                          "length": 3.0})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "micro", "tiny", seed=0, overrides=MICRO)


def test_sampled_log_rho_matches_engines_token_by_token(ckpt, one_thread):
    cfg = load_config("cpu-tiny", sets=["rollout.group_size=2", "rollout.max_new_tokens=6"])
    tokens, log_is, mask, adv, right = sample_batch(cfg, ckpt, 2, "int8")
    assert log_is.shape == mask.shape == tokens.shape and adv.shape == right.shape == (4,)
    assert bool((log_is[~mask] == 0).all()) and bool(mask.any(1).all())
    q, fp = LocalEngine(ckpt, precision="int8"), LocalEngine(ckpt, precision="bf16")
    for row in range(4):
        cols = mask[row].nonzero().flatten()
        prompt, resp = tokens[row, :int(cols[0])].tolist(), tokens[row, cols].tolist()
        want = fp.logprobs(prompt, resp) - q.logprobs(prompt, resp)  # teacher-forced, one by one
        assert torch.allclose(log_is[row, cols], want, atol=1e-4), row


def test_cli_prints_a_row_per_kind_and_correction(ckpt, capsys, one_thread):
    assert main([str(ckpt), "--preset", "cpu-tiny", "--prompts", "2", "--set",
                 "rollout.group_size=2", "--set", "rollout.max_new_tokens=6"]) == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert [r["answers"] for r in rows[:2]] == ["right", "wrong"]
    assert [r["correction"] for r in rows[2:]] == ["none", "tis", "icepop", "mis", "seqtis", "geomask"]
    assert sum(r["count"] for r in rows[:2]) == 4
