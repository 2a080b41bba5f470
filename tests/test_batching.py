"""Trajectories -> padded batch: alignment of tokens, mask, behaviour logp, staleness, advantages."""
import torch

from qurl.train.batch import build_batch
from qurl.types import Trajectory


def traj(uid, j, prompt, resp, reward, versions=None):
    return Trajectory(uid, j, torch.tensor(prompt), torch.tensor(resp),
                      -0.1 * torch.arange(1, len(resp) + 1, dtype=torch.float32),
                      torch.tensor(versions or [3] * len(resp)), reward, "stop")


def test_layout_and_advantages():
    g1 = [traj("a", 0, [5, 6], [7, 8, 9], 1.0), traj("a", 1, [5, 6], [7], 0.0, versions=[2])]
    g2 = [traj("b", 0, [4], [1, 2], 1.0), traj("b", 1, [4], [3, 3], 1.0)]
    batch, stats = build_batch([g1, g2], version=3, pad_id=0)
    assert batch.tokens.tolist()[0] == [5, 6, 7, 8, 9]
    assert batch.tokens.tolist()[1] == [5, 6, 7, 0, 0]
    assert batch.loss_mask.tolist()[1] == [0, 0, 1, 0, 0]
    assert torch.allclose(batch.behav_logp[0, 2:], torch.tensor([-0.1, -0.2, -0.3]))
    assert batch.staleness[1, 2].item() == 1 and batch.staleness[0, 2:].tolist() == [0, 0, 0]
    # group a: rewards (1, 0) -> +/-; group b: equal rewards -> zero advantage
    assert batch.adv[0] > 0 > batch.adv[1]
    assert batch.adv[2:].abs().max() == 0
    assert batch.num_tokens == 3 + 1 + 2 + 2
    # without dynamic sampling the uniform group stays in the batch but is still counted: a step
    # whose groups are all uniform has no gradient, and its metrics must say so
    assert stats["groups_uniform"] == 1
    _, all_wrong = build_batch([[traj("c", 0, [4], [1], 0.0), traj("c", 1, [4], [2], 0.0)], g2],
                               version=3, pad_id=0)
    assert all_wrong["groups_uniform"] == 2


def test_dynamic_sampling_drops_uniform_groups():
    g1 = [traj("a", 0, [5], [7], 1.0), traj("a", 1, [5], [7], 0.0)]
    g2 = [traj("b", 0, [4], [1], 1.0), traj("b", 1, [4], [3], 1.0)]
    batch, stats = build_batch([g1, g2], version=3, pad_id=0, dynamic_sampling=True)
    assert batch.prompt_uids == ["a", "a"] and stats["groups_uniform"] == 1
    none, _ = build_batch([g2], version=3, pad_id=0, dynamic_sampling=True)
    assert none is None


def test_dynamic_sampling_judges_accuracy_not_the_overlong_shaped_reward():
    """DAPO: an all-wrong group whose answers differ in length gets different shaped rewards from
    the overlong penalty; it must still be dropped (it would be trained on length alone)."""
    wrong = [traj("w", 0, [5], [7] * 2, 0.0), traj("w", 1, [5], [7] * 7, 0.0)]  # 7 is in the buffer
    mixed = [traj("m", 0, [4], [1], 1.0), traj("m", 1, [4], [3], 0.0)]
    batch, stats = build_batch([wrong, mixed], version=3, pad_id=0, dynamic_sampling=True,
                               overlong_buffer=4, max_new_tokens=8)
    assert batch.prompt_uids == ["m", "m"] and stats["groups_uniform"] == 1
    shaped, _ = build_batch([wrong], version=3, pad_id=0, overlong_buffer=4, max_new_tokens=8)
    assert shaped.rewards.tolist() == [0.0, -0.75]  # (8-4-7)/4: the shaping is what differs
