"""Request seeding shared by the sync loop and the async workers, and the train record's batch
statistics (qurl/rollout/generate.py), with values worked by hand."""
import pytest
import torch

from qurl.data.datasets import Example
from qurl.rollout.generate import group_stats
from qurl.rollout.requests import make_requests
from qurl.types import SamplingParams, Trajectory


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
    with pytest.raises(ValueError, match="empty"):
        group_stats([], trained_version=0)
