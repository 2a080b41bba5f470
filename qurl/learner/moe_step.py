"""What a learner step does for a Mixture-of-Experts model beside the dense path: check the
engine's routes that came with the batch, replay them (replay.py), watch the learner's
own routing in π_prox's forwards and turn it into the moe/ record entries (qurl/algo/routes.py).

Which positions are compared: the log-prob of token j is read from the hidden state at position
j-1, so the routing that shapes a completion token's π_prox is the one at the position *before*
it. The watched positions are therefore the loss mask shifted left by one: for a response of T
tokens after a prompt of P, positions P-1 .. P+T-2, all of which the engine forwarded (its routes
cover 0 .. P+T-2). "Completion tokens" in the moe/ metrics means exactly these T positions.

π_prox's forwards cover every row of the step once (the first mini-batch's training forward, the
no-grad forward of the others), so each step's metrics count every completion token once; the
sums are added over data-parallel ranks (TP ranks hold the same tokens and would only repeat them).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from qurl.algo.routes import RouteCounts
from qurl.learner.replay import RouteReplay


class MoEWatch:
    """The trained model's RouteReplay and this step's RouteCounts."""

    def __init__(self, replay: RouteReplay, num_experts: int) -> None:
        self.replay, self.num_experts = replay, num_experts
        self.counts = RouteCounts(replay.num_layers, num_experts)

    def reset(self) -> None:
        self.counts = RouteCounts(self.replay.num_layers, self.num_experts)
        self.replay.release()

    def observe(self, own: torch.Tensor | None, routes: torch.Tensor | None,
                watch: torch.Tensor | None) -> None:
        """own: [b, s, L, k] the learner's top-k (None: not watched); routes: [b, s, L, k] the
        engine's or None; watch: [b, s] bool positions to count."""
        if own is None or watch is None:
            return
        w = watch.to(own.device)
        self.counts.add(own[w], None if routes is None else routes.to(own.device)[w])


def moe_watch(model: torch.nn.Module, hf_config: Any, mode: str) -> MoEWatch | None:
    """The MoEWatch of a MoE model (replaying when mode == "rollout"), None for a dense one."""
    from qurl.models import convert, moe

    if mode not in ("off", "rollout"):
        raise ValueError(f"algo.routing_replay={mode!r}: must be off or rollout")
    if not convert.is_moe(hf_config):
        return None
    d = moe.moe_dims(hf_config)
    return MoEWatch(RouteReplay(model, replay=mode == "rollout", num_experts=d["E"], topk=d["k"]),
                    d["E"])


def check_routes(watch: MoEWatch | None, routes: torch.Tensor | None,
                 shape: tuple[int, ...] | torch.Size, device: torch.device) -> torch.Tensor | None:
    """routes: [B, L, layers, k] integer expert ids for tokens of `shape` [B, L], or None.
    Returns them on `device` (uint8 kept: widened per micro-batch); ValueError naming what is wrong.
    A dense model ignores none: routes for it are an error. Replay on needs them."""
    if watch is None:
        if routes is not None:
            raise ValueError("routes given for a dense model")
        return None
    if routes is None:
        if watch.replay.replay:
            raise ValueError("algo.routing_replay='rollout' but the batch carries no routes "
                             "(the engine did not return routed experts)")
        return None
    want = (*tuple(shape), watch.replay.num_layers, watch.replay.topk)
    if tuple(routes.shape) != want:
        raise ValueError(f"routes shape {tuple(routes.shape)}: expected [B, L, layers, k]={want}")
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(f"routes must hold integer expert ids, got {routes.dtype}")
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= watch.num_experts):
        raise ValueError(f"routes hold expert ids outside [0, {watch.num_experts})")
    return routes.to(device)


def watched_positions(mask: torch.Tensor) -> torch.Tensor:
    """mask: [B, L] loss mask -> [B, L] bool, True at j-1 for every loss token j (docstring)."""
    out = torch.zeros_like(mask, dtype=torch.bool)
    out[:, :-1] = mask[:, 1:].bool()
    return out


def routed_stats(watch: MoEWatch | None, dp_group: Any) -> dict[str, float]:
    """The step's moe/ entries, summed over the DP group (None: one replica); {} for a dense model.
    Forgets the step's routes (the model routes by itself again)."""
    if watch is None:
        return {}
    watch.replay.release()
    counts = watch.counts
    if dp_group is not None:
        v = counts.flat().to(watch.replay.routers[0].weight.device)  # NCCL: on the GPU
        dist.all_reduce(v, group=dp_group)
        counts.load_flat(v.cpu())
    return counts.stats()
