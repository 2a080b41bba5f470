"""Routing replay and the route-flip metrics (issue 67 items 4-5): the flip statistics on
hand-worked index tensors, and the learner on tiny-qwen3-moe sizes (tests/tiny_hf.py: 2 layers,
8 experts, top-2, fp32) at TP 1 against transformers, every spawned job in one pair of processes.

The "engine" routes are transformers' router top-k of a copy whose router weights are perturbed,
so they differ from the learner's own choice on a good share of tokens; "forced" is transformers'
forward with its routers made to pick exactly those experts (weights renormalised over them, as
Qwen3's norm_topk_prob does and megatron's replay computes from the gathered scores).
Tolerances: log-probs within 1e-4 of transformers (fp32; measured ~1.4e-6); flip fractions exact
(the learner's own top-k equals transformers' at these sizes); full recompute bit-identical.
Also: the moe/ sums over DP 2 equal DP 1's; replay refused for a dense model, in one line.
"""
from __future__ import annotations

import math

import pytest
import torch
from spawn_in_turn import spawn_in_turn
from tiny_hf import build_moe, hf_state

from qurl.algo.routes import RouteCounts, expert_sets, flips
from qurl.config import AlgoConfig, LearnerConfig, ModelConfig, OptimConfig

LOGP_TOL = 1e-4  # fp32 learner vs transformers log-probs (logits agree to ~3e-6)


# ------------------------------------------------------------------ flip statistics (pure)


def test_flips_compare_sets_not_order() -> None:
    own = torch.tensor([[[0, 1], [2, 3]],
                        [[4, 5], [6, 7]],
                        [[1, 0], [3, 2]]])  # [N=3, L=2, k=2]
    eng = torch.tensor([[[1, 0], [2, 4]],   # layer 0 same set (other order); layer 1 flips
                        [[4, 5], [6, 7]],   # no flip
                        [[1, 2], [5, 6]]])  # both layers flip
    assert flips(own, eng, 8).tolist() == [[False, True], [False, False], [True, True]]
    assert expert_sets(torch.tensor([[3, 1]]), 4).tolist() == [[False, True, False, True]]


def test_route_counts_hand_worked() -> None:
    own = torch.tensor([[[0, 1], [2, 3]],
                        [[4, 5], [6, 7]],
                        [[1, 0], [3, 2]],
                        [[0, 1], [2, 3]]])  # [4, 2, 2]
    eng = torch.tensor([[[1, 0], [2, 4]],
                        [[4, 5], [6, 7]],
                        [[1, 2], [5, 6]],
                        [[0, 1], [2, 3]]])
    c = RouteCounts(num_layers=2, num_experts=8)
    c.add(own[:2], eng[:2])  # two micro-batches add up to one
    c.add(own[2:], eng[2:])
    s = c.stats()
    # flipped (token, layer): (0, l1), (2, l0), (2, l1) -> 3 of 8; tokens with a flip: 0, 2 -> 2/4
    assert s["moe/route_flip_frac"] == pytest.approx(3 / 8)
    assert s["moe/tokens_any_flip"] == pytest.approx(2 / 4)
    assert s["moe/worst_layer_flip"] == pytest.approx(2 / 4) and s["moe/worst_layer"] == 1.0
    # layer 0 loads: e0 3, e1 3, e4 1, e5 1 (mean 8/8 = 1) -> 3; layer 1: e2 3, e3 3, e6 1, e7 1 -> 3
    assert s["moe/expert_load_max_over_mean"] == pytest.approx(3.0)
    back = RouteCounts(2, 8)
    back.load_flat(c.flat())  # what a DP all-reduce of one rank returns
    assert back.stats() == s


def test_route_counts_without_engine_routes_report_the_load_only() -> None:
    c = RouteCounts(1, 4)
    c.add(torch.tensor([[[0, 1]], [[0, 2]]]), None)
    assert c.stats() == {"moe/expert_load_max_over_mean": pytest.approx(2 / (4 / 4))}
    assert RouteCounts(1, 4).stats() == {}


# ------------------------------------------------------------------ the learner (spawned)


def _hf_routes(hf: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' router top-k: [B, S, layers, k]."""
    got = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: got.append(out[2]))
             for layer in hf.model.layers]
    with torch.no_grad():
        hf(tokens)
    for h in hooks:
        h.remove()
    B, S = tokens.shape
    return torch.stack([g.reshape(B, S, -1) for g in got], dim=2)


def _forced_logp(hf: torch.nn.Module, tokens: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """[B, S] log-probs of transformers' forward with every router forced to `routes` (weights
    renormalised over them when norm_topk_prob, as Qwen3MoeTopKRouter does)."""
    import torch.nn.functional as F

    B, S = tokens.shape
    saved = []
    for li, layer in enumerate(hf.model.layers):
        gate = layer.mlp.gate
        idx = routes[:, :, li].reshape(B * S, -1).long()

        def forward(h, gate=gate, idx=idx):
            logits = F.linear(h.reshape(-1, gate.hidden_dim), gate.weight)
            w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
            if gate.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            return logits, w.to(logits.dtype), idx
        saved.append((gate, gate.forward))
        gate.forward = forward
    try:
        with torch.no_grad():
            logits = hf(tokens).logits
    finally:
        for gate, fwd in saved:
            gate.forward = fwd
    out = torch.zeros(B, S)
    out[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return out


def _applied_routes(learner) -> tuple[list, list]:
    """Hooks recording megatron's applied routing map ([tokens, E] bool) per router."""
    from qurl.learner.replay import routers

    maps: list = []
    hooks = [r.register_forward_hook(lambda m, a, out: maps.append(out[1].detach().clone()))
             for r in routers(learner.model)]
    return maps, hooks


def _learner(hf, mode: str, recompute: str = "none"):
    from qurl.learner.megatron import MegatronLearner

    return MegatronLearner(None, ModelConfig(dtype="float32"),
                           AlgoConfig(uaq_scale=1.0, routing_replay=mode, loss="decoupled"),
                           OptimConfig(lr=1e-3), LearnerConfig(recompute=recompute),
                           total_steps=1, seed=0, hf_state=hf_state(hf), hf_config=hf.config)


def _worker(rank: int, ws: int) -> dict:
    from qurl.learner.dist import init_learner_dist
    from qurl.learner.replay import routers

    init_learner_dist(LearnerConfig(), rank, ws)
    hf = build_moe(seed=3)
    other = build_moe(seed=3)
    with torch.no_grad():  # the "engine": same model, router weights perturbed
        for layer in other.model.layers:
            layer.mlp.gate.weight.add_(0.05 * torch.randn(layer.mlp.gate.weight.shape,
                                                          generator=torch.Generator().manual_seed(5)))
    B, S, P = 4, 12, 5
    tokens = torch.randint(0, 100, (B, S), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(B, S)
    mask[:, P:] = 1.0
    mask[3, S - 3:] = 0.0  # row 3 ends early: its last 3 columns are padding
    own = _hf_routes(hf, tokens)
    engine = _hf_routes(other, tokens)
    engine[:, -1] = torch.tensor([0, 1])  # filler: the last position was never forwarded
    engine[3, S - 4:] = torch.tensor([0, 1])  # and row 3's padding + its last real position
    forced = _forced_logp(hf, tokens, engine)
    watched = torch.zeros(B, S, dtype=torch.bool)
    watched[:, :-1] = mask[:, 1:].bool()
    want = flips(own[watched], engine[watched], 8)
    out: dict = {"want_flip": float(want.double().mean()),
                 "want_any": float(want.any(-1).double().mean())}
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])

    off = _learner(hf, "off")
    maps, hooks = _applied_routes(off)
    lp_off = off.logprobs(tokens, routes=engine)
    out["off_applied_is_own"] = all(
        torch.equal(m.reshape(S, B, -1).transpose(0, 1), expert_sets(own[:, :, i], 8))
        for i, m in enumerate(maps))
    for h in hooks:
        h.remove()
    hf_own = _forced_logp(hf, tokens, own)
    out["off_vs_own"] = float(((lp_off - hf_own) * (mask > 0)).abs().max())
    out["off_stats"] = off.train_step(tokens, mask, forced * mask, adv, routes=engine)

    on = _learner(hf, "rollout")
    maps, hooks = _applied_routes(on)
    lp_on = on.logprobs(tokens, routes=engine)
    out["on_applied_is_engine"] = all(
        torch.equal(m.reshape(S, B, -1).transpose(0, 1), expert_sets(engine[:, :, i], 8))
        for i, m in enumerate(maps))
    for h in hooks:
        h.remove()
    out["on_vs_forced"] = float(((lp_on - forced) * (mask > 0)).abs().max())
    out["on_vs_own"] = float(((lp_on - hf_own) * (mask > 0)).abs().max())
    # the router's gradient flows through the gathered scores
    on.model.train()
    lp, _ = on._forward_logp(on.model, tokens.long(), 1.0, routes=engine)
    (lp * mask).sum().backward()
    out["router_grad"] = [float(r.weight.grad.abs().max()) for r in routers(on.model)]
    on.model.zero_grad()
    on.routes.replay.release()
    init = dict(on.named_weights())
    out["on_stats"] = on.train_step(tokens, mask, forced * mask, adv, routes=engine)
    after = dict(on.named_weights())
    out["router_moved"] = float((after["model.layers.0.mlp.gate.weight"]
                                 - init["model.layers.0.mlp.gate.weight"]).abs().max())
    full = _learner(hf, "rollout", recompute="full")
    out["full_stats"] = full.train_step(tokens, mask, forced * mask, adv, routes=engine)
    out["recompute_diff"] = max(float((v - after[k]).abs().max()) for k, v in full.named_weights())
    try:
        on.train_step(tokens, mask, forced * mask, adv)
    except ValueError as e:
        out["no_routes_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every spawned job of this file in one pair of processes (tests/spawn_in_turn.py): the
    replay job, the unrenormalised router, and the moe/ sums at DP 1 then DP 2."""
    jobs = [("replay", 1, _worker, ()), ("unnormalised", 1, _unnormalised_worker, ()),
            ("dp1", 1, _dp_worker, ()), ("dp2", 2, _dp_worker, ())]
    return spawn_in_turn(jobs, tmp_path_factory.mktemp("meet"))


@pytest.fixture(scope="module")
def run(runs) -> dict:
    return runs["replay"][0]


@pytest.mark.slow
def test_replay_off_routes_by_itself_and_measures_the_flips(run) -> None:
    assert run["off_applied_is_own"]  # the engine's routes are not used
    assert run["off_vs_own"] <= LOGP_TOL
    s = run["off_stats"]
    assert 0.05 < run["want_flip"] < 0.95  # the perturbed router really disagrees
    # the learner's own top-k equals transformers' (fp32, no near-ties at these sizes)
    assert s["moe/route_flip_frac"] == pytest.approx(run["want_flip"], abs=1e-9)
    assert s["moe/tokens_any_flip"] == pytest.approx(run["want_any"], abs=1e-9)
    assert s["moe/worst_layer_flip"] >= s["moe/route_flip_frac"]
    assert s["moe/worst_layer"] in (0.0, 1.0)
    assert 1.0 <= s["moe/expert_load_max_over_mean"] <= 8 / 2
    assert s["kl_behav_prox"] > 1e-4  # behav = the forced forward: the routing gap shows


@pytest.mark.slow
def test_replay_on_takes_the_engines_experts_and_keeps_router_gradients(run) -> None:
    assert run["on_applied_is_engine"]  # every position, the fillers included
    assert run["on_vs_forced"] <= LOGP_TOL
    assert run["on_vs_own"] > 100 * LOGP_TOL  # replay changes the function
    s = run["on_stats"]
    assert abs(s["kl_behav_prox"]) <= 1e-6  # π_prox (replayed) == the forced forward
    # the metrics still measure the learner's own choice (given the replayed earlier layers)
    assert s["moe/route_flip_frac"] > 0 and math.isfinite(s["moe/expert_load_max_over_mean"])
    assert min(run["router_grad"]) > 0
    assert run["router_moved"] > 0
    # full activation recompute re-runs each layer with the same experts (REPLAY_BACKWARD)
    assert run["recompute_diff"] <= 1e-6
    assert run["full_stats"]["kl_behav_prox"] == pytest.approx(s["kl_behav_prox"], abs=1e-9)
    assert "no routes" in run["no_routes_error"]


def test_replay_is_refused_for_a_dense_model() -> None:
    from tiny_hf import build

    from qurl.learner.build import build_gpt
    from qurl.models import convert

    hf = build("qwen3")
    shard = convert.hf_to_megatron(hf_state(hf), hf.config, tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match="routing_replay") as err:
        build_gpt(shard, hf.config, tp=1, dtype=torch.float32, device=torch.device("cpu"),
                  te=False, routing_replay=True)
    assert "\n" not in str(err.value)


def test_replay_on_a_dense_run_is_refused_in_one_line(tmp_path, capsys) -> None:
    from qurl.cli import main

    rc = main(["train", "--set", "algo.routing_replay=rollout", "--set",
               f"deploy.dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "algo.routing_replay=rollout" in err[0] and "dense" in err[0]


def _dp_worker(rank: int, ws: int) -> dict:
    """Replay off, one step on the same batch with learner.dp = ws: the moe/ entries."""
    from qurl.learner.dist import init_learner_dist

    init_learner_dist(LearnerConfig(dp=ws), rank, ws)
    hf = build_moe(seed=3)
    from qurl.learner.megatron import MegatronLearner

    learner = MegatronLearner(None, ModelConfig(dtype="float32"), AlgoConfig(uaq_scale=1.0),
                              OptimConfig(), LearnerConfig(dp=ws), total_steps=1, seed=0,
                              hf_state=hf_state(hf), hf_config=hf.config)
    tokens = torch.randint(0, 100, (4, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(4, 10)
    mask[:, 4:] = 1.0
    engine = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2]
                          for i in range(4 * 10 * 2)]).reshape(4, 10, 2, 2)
    stats = learner.train_step(tokens, mask, -torch.rand(4, 10) * mask, torch.tensor([1., -1, 1, -1]),
                               routes=engine)
    return {k: v for k, v in stats.items() if k.startswith("moe/")}


@pytest.mark.slow
def test_moe_stats_are_summed_over_data_parallel_ranks(runs) -> None:
    one, two = runs["dp1"][0], runs["dp2"]
    assert set(one) == {"moe/route_flip_frac", "moe/tokens_any_flip", "moe/worst_layer_flip",
                        "moe/worst_layer", "moe/expert_load_max_over_mean"}
    for got in two:  # every DP rank reports the whole batch's numbers
        assert got == pytest.approx(one, abs=1e-12)


def _unnormalised_worker(rank: int, ws: int) -> float:
    """norm_topk_prob=False (megatron's pre-softmax router: the replay gathers softmax scores):
    max |replayed learner log-prob - forced transformers log-prob|."""
    from qurl.learner.dist import init_learner_dist

    init_learner_dist(LearnerConfig(), rank, ws)
    hf = build_moe(seed=4, norm_topk_prob=False)
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    engine = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2]
                          for i in range(2 * 9 * 2)]).reshape(2, 9, 2, 2)
    lp = _learner(hf, "rollout").logprobs(tokens, routes=engine)
    return float((lp - _forced_logp(hf, tokens, engine)).abs().max())


@pytest.mark.slow
def test_replay_matches_forced_routes_without_renormalisation(runs) -> None:
    assert runs["unnormalised"][0] <= LOGP_TOL
