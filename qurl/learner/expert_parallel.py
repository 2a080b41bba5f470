"""Expert parallelism (learner.ep): a mixture of experts' experts divided over data-parallel ranks.

With learner.ep = P > 1 the learner's D data-parallel ranks form D/P expert-parallel (EP) groups of
P ranks (megatron-core's `expert_model_parallel_size`; its default rank order "tp-cp-ep-dp-pp"
puts P consecutive DP replicas in one group). Within a group, EP rank r holds experts
[r·E/P, (r+1)·E/P) of every layer (megatron's `SequentialMLP` names them local experts 0..E/P-1);
the attention, norms, router and embeddings stay whole on every rank, as with plain DP. Ranks
holding the same experts (one per EP group) form an expert-data-parallel (expert-DP) group of D/P
ranks.

The forward: megatron's allgather token dispatcher (`MoEAllGatherTokenDispatcher`) all-gathers
every EP rank's tokens (hidden states, routing map, probabilities) over the EP group (TP x EP),
runs this rank's experts on the tokens routed to them, and reduce-scatters the outputs back, each
rank receiving the sum over the group's experts for its own tokens. Both are collectives of equal
shapes: every rank of an EP group must run the same number of forwards on the same [rows, width],
so the micro-batch plan is agreed over the group (`peer_ends`, `plan_widths`: every rank knows the
whole batch, so the widths need no collective; the rows per micro-batch follow from the width).

The gradients: the dispatcher's backward already sums each expert's gradient over the EP group's
tokens; the optimizer (distopt.py) sums it further over the expert-DP group, where the dense
parameters are summed over the whole DP group, and shards the experts' masters over expert-DP
with deploy.ranks.distributed_optimizer.

Out of the learner: `gather_experts` all-gathers the expert shards over the EP group for
`named_weights` and yields them under their global names in the order of a learner holding every
expert (layer by layer, expert 0..E-1), so the weight sync and `qurl export` see exactly what they
see at ep = 1.

Invariants: E % P == 0 and D % P == 0 (qurl/config/rules.py, qurl/models/fits.py); at P = 1 nothing
here changes what the learner computes.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qurl.models import moe


@dataclass(frozen=True)
class ExpertParallel:
    """Where this rank sits for the experts: EP rank/size/group, expert-DP rank/size/group (groups
    None when their size is 1), experts per rank, and the DP ranks of this EP group's members in EP
    rank order (`peers`)."""
    rank: int = 0
    size: int = 1
    group: Any = None
    data_rank: int = 0
    data_size: int = 1
    data_group: Any = None
    per_rank: int = 0  # E / size (0: a dense model)
    peers: tuple[int, ...] = (0,)

    @classmethod
    def current(cls, num_experts: int, dp_rank: int, device: torch.device) -> ExpertParallel:
        """This rank's place, from megatron's parallel_state (init_learner_dist built it); a
        collective over the EP group when its size is > 1 (learning the peers' DP ranks)."""
        from megatron.core import parallel_state as ps

        size = ps.get_expert_model_parallel_world_size()
        if size == 1:
            return cls(per_rank=num_experts, peers=(dp_rank,))
        if not num_experts or num_experts % size:
            raise ValueError(f"learner.ep={size}: must divide the model's experts "
                             f"({num_experts or 'none: a dense model'})")
        group = ps.get_expert_model_parallel_group()
        mine = torch.tensor([dp_rank], dtype=torch.int64, device=device)
        peers = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(peers, mine, group=group)
        data_size = ps.get_expert_data_parallel_world_size()
        return cls(ps.get_expert_model_parallel_rank(), size, group,
                   ps.get_expert_data_parallel_rank(), data_size,
                   ps.get_expert_data_parallel_group() if data_size > 1 else None,
                   num_experts // size, tuple(int(p) for p in peers))

    def local_shard(self, shard: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
        """This rank's experts of a Megatron shard holding all of them, renumbered from 0."""
        return moe.ep_shard(shard, self.rank, self.size, num_experts) if self.size > 1 else shard

    def peer_ends(self, ends: torch.Tensor, offset: int, share: int) -> torch.Tensor | None:
        """[size, share] the `ends` of each EP group member's rows, in EP rank order, where DP
        rank d computes rows [offset + d·share, offset + (d+1)·share) of the batch (every rank
        knows the whole batch, so no collective is needed); None at size 1."""
        if self.size == 1:
            return None
        return torch.stack([ends[offset + d * share: offset + (d + 1) * share] for d in self.peers])

    def gather_experts(self, items: Iterable[tuple[str, list[torch.Tensor]]]
                       ) -> Iterator[tuple[str, list[torch.Tensor]]]:
        """(Megatron name, TP shards) of every parameter, this rank's local experts included ->
        the same with every EP rank's experts under their global names, each layer's experts
        together in global order (where the layer's local experts end). A collective over the EP
        group (every member must exhaust it); identity at size 1."""
        if self.size == 1:
            yield from items
            return
        layer: str | None = None
        held: dict[int, list[tuple[str, list[torch.Tensor]]]] = {}  # global expert -> its params
        for name, shards in items:
            parts = moe.expert_index(name)
            if layer is not None and (parts is None or parts[0] != layer):
                yield from _in_order(held)
                layer, held = None, {}
            if parts is None:
                yield name, shards
                continue
            layer = parts[0]
            every = [self._all_gather(s) for s in shards]  # [tp shard][ep rank]
            for r in range(self.size):
                e = r * self.per_rank + parts[1]
                held.setdefault(e, []).append((f"{parts[0]}{e}{parts[2]}", [g[r] for g in every]))
        yield from _in_order(held)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out


def _in_order(held: dict[int, list[tuple[str, list[torch.Tensor]]]]
              ) -> Iterator[tuple[str, list[torch.Tensor]]]:
    for e in sorted(held):
        yield from held[e]


def expert_flags(names: Sequence[str]) -> list[bool]:
    """Which of these Megatron parameter names are routed experts (held per EP rank)."""
    return [moe.expert_index(n) is not None for n in names]


def plan_widths(peer_ends: torch.Tensor) -> torch.Tensor:
    """peer_ends [P, n] (`ExpertParallel.peer_ends`) -> [n] the widths an EP group's micro-batches
    agree on: each member's row ends sorted longest first, the maximum over the members at each
    position. A micro-batch starting at sorted position i is that wide on every member."""
    return peer_ends.sort(dim=1, descending=True, stable=True).values.amax(dim=0)
