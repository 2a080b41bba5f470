"""Request seeding shared by the sync loop and the async workers, and the train record's batch
statistics (qurl/train/generate.py), with values worked by hand."""
import pytest
import torch

from qurl.data import rewards
from qurl.data.datasets import Example
from qurl.data.synthetic import arithmetic_task
from qurl.train.generate import group_stats, to_trajectories
from qurl.train.requests import make_requests
from qurl.types import GenResult, SamplingParams, Trajectory


def test_dispatch_keys_name_requests_but_do_not_change_seeds():
    exs = [Example("arith:1+2", "1+2", "3"), Example("arith:4+4", "4+4", "8")]
    ids = [[5, 6, 7], [8, 9]]
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    sync = make_requests(exs, ids, params, group_size=2, run_seed=7, step=3)
    keyed = make_requests(exs, ids, params, group_size=2, run_seed=7, step=3,
                          keys=["arith:1+2@11", "arith:4+4@12"])
    assert [r.rid for r in sync] == ["arith:1+2#0", "arith:1+2#1", "arith:4+4#0", "arith:4+4#1"]
    assert [r.rid for r in keyed] == ["arith:1+2@11#0", "arith:1+2@11#1", "arith:4+4@12#0",
                                      "arith:4+4@12#1"]
    # an async worker samples exactly what the sync loop would for the same prompt and step
    assert [r.params.seed for r in keyed] == [r.params.seed for r in sync]
    assert len({r.params.seed for r in sync}) == 4  # per prompt and per sample
    later = make_requests(exs, ids, params, group_size=2, run_seed=7, step=4)
    assert not {r.params.seed for r in later} & {r.params.seed for r in sync}  # per step
    assert [r.prompt_ids for r in sync] == [[5, 6, 7]] * 2 + [[8, 9]] * 2
    with pytest.raises(ValueError):
        make_requests(exs, ids[:1], params, group_size=2, run_seed=7, step=3)


def _traj(uid, n, versions, reward, finish="stop", timed_out=False):
    return Trajectory(prompt_uid=uid, sample_idx=0, prompt_ids=torch.tensor([1, 2]),
                      response_ids=torch.arange(n), behav_logp=torch.zeros(n),
                      versions=torch.tensor(versions), reward=reward, finish_reason=finish,
                      reward_timed_out=timed_out)


def test_group_stats_by_hand():
    groups = [[_traj("a", 2, [3, 3], 1.0), _traj("a", 3, [2, 2, 3], 0.0, finish="length")],
              [_traj("b", 1, [1], 0.0, timed_out=True), _traj("b", 2, [3, 3], 1.0)]]
    s = group_stats(groups, trained_version=3)
    assert s["reward"] == 0.5 and s["response_len"] == 2.0
    assert s["truncated_frac"] == 0.25 and s["reward_timeouts"] == 1.0
    # staleness per token: [0,0], [1,1,0], [2], [0,0] -> 4/8
    assert s["staleness_mean"] == 0.5 and s["staleness_max"] == 2.0
    assert "behav_entropy" not in s  # no engine reported one: no key, never a 0
    # the engine's entropy: a token mean over the trajectories that carry it
    groups[0][0].behav_entropy = torch.tensor([1.0, 2.0])
    groups[1][1].behav_entropy = torch.tensor([0.5, 0.5])
    assert group_stats(groups, trained_version=3)["behav_entropy"] == 1.0
    with pytest.raises(ValueError, match="empty"):
        group_stats([], trained_version=0)


class _ByteCodec:
    """decode() of a byte-level tokenizer: token id = byte value (all to_trajectories asks of a codec)."""

    @staticmethod
    def decode(ids: torch.Tensor) -> str:
        return bytes(ids.tolist()).decode()


def test_arithmetic_rewards_refuse_the_copied_question_in_rollout_and_eval():
    """The path every rollout and evaluation scores through: an arithmetic example's answer kind
    reaches the reward, so boxing the question (math-verify would evaluate it) scores 0, and the
    same box for a "math" example with the same gold scores 1."""
    ex = arithmetic_task(1, seed=0, split="train", digits=1, n_operands=3)[0]
    assert ex.answer_kind == "number"
    q = ex.prompt.rstrip("=")
    same_gold = Example("math:x", "x", ex.answer)  # default kind "math"
    texts = {f"{ex.uid}#0": f"\\boxed{{{q}}}", f"{ex.uid}#1": f"{q}={ex.answer}. \\boxed{{{ex.answer}}}",
             "math:x#0": f"\\boxed{{{q}}}"}
    results = [GenResult(rid=rid, prompt_ids=[1], output_ids=torch.tensor(list(t.encode())),
                         logprobs=torch.zeros(len(t)), versions=torch.zeros(len(t), dtype=torch.int64),
                         finish_reason="stop") for rid, t in texts.items()]
    groups = to_trajectories(results, [ex, same_gold], _ByteCodec(), reward_timeout_s=10.0)
    assert [[t.reward for t in g] for g in groups] == [[0.0, 1.0], [1.0]]
    rewards.shutdown_default()
    with pytest.raises(ValueError, match="answer_kind"):
        Example("u", "p", "1", answer_kind="integer")
