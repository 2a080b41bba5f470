"""Routing replay: the learner's MoE layers use the experts the rollout engine chose, and the
learner's own choice is watched beside them (issue 67 items 4 and 5).

**Why.** The 8-bit engine and the full-precision learner route some tokens to different experts
(qurl/algo/routes.py). Then π_prox/π_behav measures a different network, not a quantization error,
and the importance weights explode. With `algo.routing_replay = "rollout"` every forward of the
policy being trained (π_prox's no-grad forward, the training forwards of every mini-batch, and the
re-run of a layer under activation recompute) takes its top-k sets from the engine.

**How** (megatron-core 0.16.1, `transformer/moe/router_replay.py`, read there): with
`moe_enable_routing_replay=True` each `TopKRouter` owns a `RouterReplay`, created in the router's
constructor, so the model's routers in module order are the MoE layers in model order. Per layer:
- `set_target_indices(idx [tokens, k])` gives the experts; the action `REPLAY_FORWARD` makes
  `topk_routing_with_score_function` use them instead of its own top-k and *gather the router's
  scores at those indices*: the mixing weights (softmax over the k gathered logits for Qwen3's
  renormalised top-k) stay functions of the router weight, which so keeps its gradient;
- every `set_target_indices` also appends to a per-layer queue that the action `REPLAY_BACKWARD`
  pops, once per re-run forward of that layer: the re-run under activation recompute (full
  recompute re-runs each layer in the backward) sees the same experts.
megatron's static helpers walk one global list of every RouterReplay ever built in the process (the
frozen reference model's, other learners'); `RouteReplay` drives only its own model's instances.
The frozen reference model of the KL term (algo.kl_coef > 0) is built without replay and routes by
itself: the KL is to the initial policy as it would run, not along the engine's path.
Token order: megatron's hidden states are [s, b, h], the router flattens them to s·b rows, so row
i·b + j is sequence j's position i.

**The learner's own choice** is read, whatever the mode, by a forward hook on each router while a
forward is *watched* (π_prox's forwards, once per step): it recomputes the router's scores from the
router's input (one [tokens, H]×[H, E] product, no grad) and takes their top-k as megatron's own
routing would (`moe_router_pre_softmax`: top-k of the softmax, else of the logits: the same set).
With replay on, a layer's input comes from the replayed earlier layers, i.e. from the engine's
path, so a flip at layer l is that layer's own disagreement given the engine's history, not the
compounded drift of every layer before it; with replay off it is exactly the learner's routing.
(megatron's RECORD action would give the same with replay off but cannot run beside
REPLAY_FORWARD: one action per layer.)

**Positions the engine never forwarded.** The engine returns routes for positions 0 .. P+T-2 of a
sequence (prompt and completion but the last sampled token, which it never fed back). The
learner's batch fills the last position and the right padding with experts 0..k-1
(qurl/train/batch.py `pad_routes`), a valid set of k distinct experts. They cannot change the
loss: under causal attention a position only influences itself and later ones, the head reads
hidden states 0 .. L-2 only (the log-prob of token j comes from position j-1), and the last real
position's output and everything after it reach no loss token (padding's log-probs are masked out).
"""
from __future__ import annotations

from typing import Any

import torch


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers (megatron `TopKRouter`s) in model order (layer 0 first)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class RouteReplay:
    """One model's routing replay and watch (module docstring). `replay`: whether forwards given
    routes take them (the model must be built with `moe_enable_routing_replay`)."""

    def __init__(self, model: torch.nn.Module, *, replay: bool, num_experts: int, topk: int) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ValueError("RouteReplay: the model has no MoE router")
        self.replay, self.num_experts, self.topk = replay, num_experts, topk
        if replay and any(getattr(r, "router_replay", None) is None for r in self.routers):
            raise ValueError("RouteReplay: build the model with moe_enable_routing_replay=True")
        self._own: list[torch.Tensor | None] = [None] * len(self.routers)
        self._watching = False
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def _hook(self, layer: int):
        def hook(router: torch.nn.Module, args: tuple[Any, ...], _out: Any) -> None:
            if not self._watching:
                return
            with torch.no_grad():
                logits = router.gating(args[0])  # [s, b, E] (fp32: moe_router_dtype)
                if router.config.moe_router_pre_softmax:
                    logits = torch.softmax(logits, dim=-1, dtype=torch.float32)
                self._own[layer] = logits.topk(self.topk, dim=-1).indices  # [s, b, k]
        return hook

    def begin(self, routes: torch.Tensor | None, *, watch: bool) -> None:
        """Before a forward of tokens [b, s]. routes: [b, s, L, k] expert ids to replay (ignored
        unless `replay`; None: the model's own routing); watch: record the own choice."""
        self._own = [None] * self.num_layers
        self._watching = watch
        for r in self.routers:
            rr = getattr(r, "router_replay", None)
            if rr is not None:
                rr.clear_indices()
                rr.clear_router_replay_action()
        if not (self.replay and routes is not None):
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if routes.shape[2:] != (self.num_layers, self.topk):
            raise ValueError(f"routes {tuple(routes.shape)}: expected [b, s, {self.num_layers}, "
                             f"{self.topk}]")
        dev = self.routers[0].weight.device
        for layer, r in enumerate(self.routers):
            idx = routes[:, :, layer].transpose(0, 1).reshape(-1, self.topk)  # row i·b + j
            r.router_replay.set_target_indices(idx.to(dev, torch.long))
            r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def end(self) -> torch.Tensor | None:
        """After the forward: the own top-k [b, s, L, k] when watched (else None). Replayed layers
        switch to REPLAY_BACKWARD, so a re-run under recompute takes the same experts."""
        own = None
        if self._watching:
            own = torch.stack([o.transpose(0, 1) for o in self._own], dim=2)  # type: ignore[union-attr]
        self._watching = False
        self._own = [None] * self.num_layers
        if self.replay:
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            for r in self.routers:
                if r.router_replay.target_topk_idx is not None:
                    r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return own

    def release(self) -> None:
        """Forget the routes and actions (the model routes by itself again)."""
        self._watching = False
        self._own = [None] * self.num_layers
        for r in self.routers:
            rr = getattr(r, "router_replay", None)
            if rr is not None:
                rr.clear_indices()
                rr.clear_router_replay_action()
