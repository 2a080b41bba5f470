"""Evaluation metrics: unbiased pass@k against brute-force enumeration of every k-subset, Avg@k and
the mean over sets by hand, and one engine scored on two sets (greedy, Avg@k, pass@k) with a
scripted engine whose right answers are known (tests/test_dynamic_sampling.py)."""
from __future__ import annotations

import itertools
import math

import pytest
from test_dynamic_sampling import DATA, ScriptedEngine

from qurl.config import ConfigError, load_config
from qurl.data.rewards import extract_answer
from qurl.train.eval_metrics import mean_over_sets, pass_at_k, set_metrics
from qurl.train.eval_suite import score_engine, summary
from qurl.train.requests import PromptCodec


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the C(n, k) k-subsets of n samples (the first c right) holding a right one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12)
    # closed form at a size too large to enumerate: 1 - C(n-c, k)/C(n, k)
    assert pass_at_k(32, 3, 8) == pytest.approx(1 - math.comb(29, 8) / math.comb(32, 8), rel=1e-12)
    assert pass_at_k(32, 5, 1) == pytest.approx(5 / 32)  # pass@1 = c/n
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_set_metrics_and_mean_over_sets() -> None:
    m = set_metrics([4, 0, 2], 4, (2,))  # three problems, 4 samples each
    assert m["avg@4"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert m["pass@2"] == pytest.approx((1 + 0 + (1 - 1 / 6)) / 3)  # C(2,2)/C(4,2) = 1/6
    mean = mean_over_sets({"a": {"greedy": 1.0, "avg@4": 0.5}, "b": {"greedy": 0.0}})
    assert mean == {"greedy": 0.5}  # only what every set reports; each set counts once


def test_score_engine_on_two_sets() -> None:
    engine = ScriptedEngine()  # prompt i: always right if i is even, else right on even samples
    sets = {"even": DATA[0:6:2], "odd": DATA[1:9:2]}
    ecfg = load_config(sets=["eval.samples=4", "eval.pass_k=1,2"]).eval
    counts: dict[str, list[int]] = {}
    out = score_engine(engine, sets, PromptCodec(engine.tokenizer, "plain"), ecfg,
                       max_new_tokens=8, run_seed=0, reward_timeout_s=5.0, counts=counts)
    assert counts == {"even/greedy": [1] * 3, "odd/greedy": [1] * 4,
                      "even/avg@4": [4] * 3, "odd/avg@4": [2] * 4}
    assert out["even/greedy"] == out["odd/greedy"] == 1.0  # greedy is sample 0: right
    assert out["even/avg@4"] == 1.0 and out["odd/avg@4"] == 0.5
    assert out["odd/pass@1"] == 0.5 and out["odd/pass@2"] == pytest.approx(5 / 6)
    assert out["mean/avg@4"] == 0.75 and out["mean/pass@2"] == pytest.approx((1 + 5 / 6) / 2)
    assert engine.calls == [3 + 4, (3 + 4) * 4]  # one greedy call, one sampled call
    rec = {"step": 3, "n": 7.0, **{f"eval/{k}": v for k, v in out.items()}}
    assert summary(rec).startswith("[eval] step 3: avg@4 0.750") and "2 set(s)" in summary(rec)


def test_score_engine_keeps_the_greedy_answers_text_in_set_order() -> None:
    engine = ScriptedEngine()  # greedy is sample 0: `\boxed{i}` for prompt q<i>
    sets = {"even": DATA[0:6:2], "odd": DATA[1:9:2]}
    answers: dict[str, list[str]] = {}
    score_engine(engine, sets, PromptCodec(engine.tokenizer, "plain"),
                 load_config(sets=["eval.samples=2"]).eval, max_new_tokens=8, run_seed=0,
                 reward_timeout_s=5.0, answers=answers)
    assert sorted(answers) == ["even/greedy", "odd/greedy"]  # no texts of sampled answers
    for name, exs in sets.items():
        got = [extract_answer(t) for t in answers[f"{name}/greedy"]]
        assert got == [ex.uid[1:] for ex in exs]


def test_eval_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="eval.pass_k"):
        load_config(sets=["eval.samples=4", "eval.pass_k=8"])
    with pytest.raises(ConfigError, match="measure nothing"):
        load_config(sets=["eval.greedy=false"])
    with pytest.raises(ConfigError, match="data.eval"):
        from qurl.data.splits import load_eval_sets

        load_eval_sets(load_config(sets=["data.eval=aime24,aime24"]).data, 0)
    with pytest.raises(ConfigError, match="data.eval_size=0"):
        load_eval_sets(load_config(sets=["data.eval=synthetic,aime24", "data.eval_size=0"]).data, 0)


def _needs_fp_policy(cfg) -> bool:
    from qurl.train.eval_suite import needs_fp_policy

    return needs_fp_policy(cfg.eval, cfg.rollout)


def test_fp_policy_is_scored_only_beside_a_quantized_engine() -> None:
    needs_fp_policy = _needs_fp_policy

    assert needs_fp_policy(load_config(sets=["rollout.precision=int8"]))
    assert needs_fp_policy(load_config(sets=["rollout.precision=fp8"]))
    assert not needs_fp_policy(load_config(sets=["rollout.precision=bf16"]))  # nothing to compare
    assert not needs_fp_policy(load_config(sets=["eval.fp_policy=false"]))


@pytest.mark.parametrize("preset", ["paper-ppo-gsm8k", "paper-deepscaler-1.5b", "paper-dapo-7b"])
def test_paper_presets_do_not_score_the_fp_policy_in_the_learner(preset) -> None:
    """Their evaluations (up to 20k tokens, Avg@32) would not fit qurl's fp32 decoder beside the
    learner on its GPU; the preset's 8-bit rollout would otherwise turn it on."""
    needs_fp_policy = _needs_fp_policy

    cfg = load_config(preset)
    assert cfg.eval.fp_policy is False and not needs_fp_policy(cfg)
    assert needs_fp_policy(load_config(preset, sets=["eval.fp_policy=true",
                                                     "rollout.precision=int8"]))
