"""Turn scored trajectories into the learner's padded training batch.

Layout: one row per trajectory, `tokens = prompt ++ response`, right-padded to the longest row.
Every per-token tensor is aligned with `tokens`: column j describes token j, whose log-prob is
log p(tokens[j] | tokens[:j]). So `loss_mask` is 1 exactly on response columns, `behav_logp` holds
the engine's log-prob there (0 elsewhere), and `staleness` = learner version − version that sampled
the token (0 = on-policy apart from quantization). Advantages are per sequence, computed within each
prompt's group of G samples.

Mixture-of-Experts: `routes` [B, L, layers, k] holds, at column j, the experts the engine chose at
position j (Trajectory.routed_experts, which covers positions 0 .. P+T-2: the last sampled token was
never forwarded). The columns without an engine choice, each row's last token and its right padding,
hold experts 0..k-1 (`pad_routes`): a valid set of k distinct experts, which the learner may
replay there because those positions reach no loss token (qurl/learner/replay.py). None for a dense
model, or when any trajectory of the batch lacks routes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qurl.algo.advantages import grpo_advantages, overlong_penalty, uniform_groups
from qurl.types import Trajectory


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # [B, L] int64
    loss_mask: torch.Tensor  # [B, L] float32
    behav_logp: torch.Tensor  # [B, L] float32
    staleness: torch.Tensor  # [B, L] int64
    adv: torch.Tensor  # [B] float32
    rewards: torch.Tensor  # [B] float32 (after shaping)
    prompt_uids: list[str]
    routes: torch.Tensor | None = None  # [B, L, layers, k] uint8/int32 (MoE; module docstring)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def build_batch(
    groups: list[list[Trajectory]],
    *,
    version: int,
    pad_id: int,
    advantage: str = "grpo",
    dynamic_sampling: bool = False,
    overlong_buffer: int = 0,
    overlong_penalty_value: float = 1.0,
    max_new_tokens: int | None = None,
) -> tuple[TrainBatch | None, dict[str, float]]:
    """Pack complete groups (each the G samples of one prompt) into a TrainBatch.

    dynamic_sampling: drop groups whose accuracies (rewards before overlong shaping) are all equal;
    the loops fill the batch beforehand (dynamic_sampling.py), so this only guards.
    Returns (batch or None if dynamic sampling dropped every group, stats)."""
    if advantage not in ("grpo", "drgrpo"):
        raise ValueError(f"advantage={advantage!r}: must be grpo or drgrpo")
    trajs = [t for g in groups for t in g]
    if not trajs:
        raise ValueError("build_batch: no trajectories")
    group_ids = torch.tensor([gi for gi, g in enumerate(groups) for _ in g])
    accuracy = torch.tensor([t.reward for t in trajs], dtype=torch.float32)  # verifiable, 0/1
    rewards = accuracy
    lengths = torch.tensor([len(t.response_ids) for t in trajs])
    if overlong_buffer > 0:
        if max_new_tokens is None:
            raise ValueError("overlong shaping needs max_new_tokens")
        rewards = rewards + overlong_penalty(
            lengths, max_len=max_new_tokens, buffer_len=overlong_buffer, penalty=overlong_penalty_value)
    adv = grpo_advantages(rewards, group_ids, scale_by_std=(advantage == "grpo"))
    # groups whose G accuracies are all equal carry no GRPO signal (counted with or without
    # dynamic sampling: a step where every group is uniform is a step without a gradient)
    uniform = uniform_groups(accuracy, group_ids)
    stats = {"groups": float(len(groups)),
             "groups_uniform": float(len(set(group_ids[uniform].tolist())))}
    if dynamic_sampling:
        # DAPO judges groups on accuracy: an all-wrong group must not survive on length shaping
        keep = (~uniform).nonzero().flatten().tolist()
        if not keep:
            return None, stats
        trajs = [trajs[i] for i in keep]
        adv, rewards = adv[keep], rewards[keep]

    seq_lens = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    B, L = len(trajs), max(seq_lens)
    tokens = torch.full((B, L), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(B, L)
    behav = torch.zeros(B, L)
    stale = torch.zeros(B, L, dtype=torch.int64)
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        tokens[i, :p] = t.prompt_ids
        tokens[i, p:p + r] = t.response_ids
        loss_mask[i, p:p + r] = 1.0
        behav[i, p:p + r] = t.behav_logp.float()
        stale[i, p:p + r] = version - t.versions
    batch = TrainBatch(tokens, loss_mask, behav, stale, adv.float(), rewards,
                       [t.prompt_uid for t in trajs], pad_routes(trajs, L))
    return batch, stats


def pad_routes(trajs: list[Trajectory], width: int) -> torch.Tensor | None:
    """[B, width, layers, k] the trajectories' routed experts aligned with their token columns,
    experts 0..k-1 where the engine gave none (module docstring); None unless every one has routes."""
    if not trajs or any(t.routed_experts is None for t in trajs):
        return None
    first = trajs[0].routed_experts
    layers, k = first.shape[1:]
    out = torch.arange(k, dtype=first.dtype).expand(len(trajs), width, layers, k).clone()
    for i, t in enumerate(trajs):
        r = t.routed_experts
        n = len(t.prompt_ids) + len(t.response_ids) - 1
        if r.shape != (max(n, 0), layers, k):
            raise ValueError(f"trajectory {t.prompt_uid!r} sample {t.sample_idx}: routed_experts "
                             f"{tuple(r.shape)}, expected [P + T - 1 = {n}, {layers}, {k}]")
        out[i, :n] = r
    return out
