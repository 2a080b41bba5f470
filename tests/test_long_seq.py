"""The learner at long lengths (issue 56): SDPA attention, activation recompute, the chunked head,
and one micro-batch plan agreed by every rank — each against the path it replaces, on real
megatron-core with gloo at TP 1 and TP 2.

- SDPA (qurl/learner/attention.py) vs megatron's unfused DotProductAttention: logits, log-probs and
  gradients, fp32 and bf16; and the kernel that runs is SDPA's fused flash kernel, not its L x L
  math fallback (torch's profiler names the op).
- learner.recompute none / selective / full: gradients unchanged.
- The head in chunks of positions (qurl/learner/logits.py, LOGITS_CHUNK shrunk to force many
  chunks): log-probs and gradients equal the one-piece head.
- Ranks reading different free GPU memory (stubbed: this machine has no GPU) still run one
  micro-batch plan and finish a train step; each rank's own reading would have split differently.

Tolerances: fp32 paths agree to 2e-5 (absolute on log-probs and logits, relative to the largest
gradient element) — the kernels sum in different orders; bf16 is judged against the fp32 answer:
SDPA's bf16 error may be at most 1.5x the unfused path's (it accumulates in fp32 where the unfused
path rounds its scores to bf16).
"""
from __future__ import annotations

import pytest
import torch
from spawn_in_turn import spawn_in_turn
from tiny_hf import build, hf_state

from qurl.config import (AlgoConfig, CorrectionConfig, LearnerConfig, ModelConfig,
                         OptimConfig, RanksDeployConfig)

ALGO = AlgoConfig(loss="acr", mini_batches=2, epochs=1, uaq_scale=1.0, clip=(0.2, 0.2),
                  correction=CorrectionConfig(cap=2.0))
OPTIM = OptimConfig(lr=1e-3, grad_clip=1.0)
B, L = 6, 24


def _learner(kind: str, tp: int, *, attention: str = "sdpa", recompute: str = "none",
             dtype: str = "float32"):
    from qurl.learner.megatron import MegatronLearner

    model = build(kind)
    return MegatronLearner(None, ModelConfig(dtype=dtype), ALGO, OPTIM,
                           LearnerConfig(tp=tp, recompute=recompute), total_steps=4, seed=0,
                           ranks=RanksDeployConfig(attention=attention), hf_state=hf_state(model),
                           hf_config=model.config)


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 100, (B, L), generator=torch.Generator().manual_seed(seed))


def _logp_and_grad(learner, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-mode log-probs of every column and the gradient of their weighted sum over this
    rank's parameters (flattened, model order; fp32)."""
    learner.model.train()
    learner.model.zero_grad(set_to_none=True)
    lp = learner._forward_logp(learner.model, tokens.to(learner.device), 1.0)[0]
    w = torch.linspace(0.5, 1.5, lp.shape[1])
    (lp * w).sum().backward()
    grad = torch.cat([p.grad.float().flatten() for p in learner.model.parameters()])
    return lp.detach().float(), grad


def _count_calls(model: torch.nn.Module) -> dict[str, int]:
    """Forward calls of layer 0, its core attention and its MLP (recompute calls them again in the
    backward), counted from now on."""
    layer = model.decoder.layers[0]
    calls = {"layer": 0, "core_attention": 0, "mlp": 0}
    for name, mod in (("layer", layer), ("core_attention", layer.self_attention.core_attention),
                      ("mlp", layer.mlp)):
        mod.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    return calls


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _worker(rank: int, ws: int) -> dict:
    import qurl.learner.logits as lg
    from qurl.learner.dist import init_learner_dist

    init_learner_dist(LearnerConfig(tp=ws), rank, ws)
    out: dict = {}
    tokens = _tokens()
    for kind in ("qwen2", "qwen3", "llama"):
        ref = _learner(kind, ws, attention="unfused")
        sdpa = _learner(kind, ws)
        lp_u, g_u = _logp_and_grad(ref, tokens)
        lp_s, g_s = _logp_and_grad(sdpa, tokens)
        out[f"{kind}/fp32"] = (float((lp_s - lp_u).abs().max()), _rel(g_s, g_u),
                               float((sdpa.logits(tokens) - ref.logits(tokens)).abs().max()))
        # bf16: both paths against the fp32 answer
        lp_bu, _ = _logp_and_grad(_learner(kind, ws, attention="unfused", dtype="bfloat16"), tokens)
        lp_bs, _ = _logp_and_grad(_learner(kind, ws, dtype="bfloat16"), tokens)
        out[f"{kind}/bf16"] = (float((lp_bs - lp_u).abs().max()), float((lp_bu - lp_u).abs().max()))
        # recompute: same gradients
        for how in ("none", "selective", "full"):
            rec = _learner(kind, ws, recompute=how)
            calls = _count_calls(rec.model)
            lp_r, g_r = _logp_and_grad(rec, tokens)
            out[f"{kind}/recompute/{how}"] = (float((lp_r - lp_s).abs().max()), _rel(g_r, g_s),
                                              dict(calls))
        # the head in chunks of 7 positions (B x L = 144 -> 21 chunks, one partial)
        whole = lg.LOGITS_CHUNK
        lg.LOGITS_CHUNK = 7 * sdpa._local_vocab
        try:
            lp_c, g_c = _logp_and_grad(sdpa, tokens)
            with torch.no_grad():
                lp_nc = sdpa.logprobs(tokens)
                ent_c = sdpa._forward_logp(sdpa.model, tokens, 1.0, entropy=True)[1]
        finally:
            lg.LOGITS_CHUNK = whole
        with torch.no_grad():
            ent = sdpa._forward_logp(sdpa.model, tokens, 1.0, entropy=True)[1]
        out[f"{kind}/chunked"] = (float((lp_c - lp_s).abs().max()), _rel(g_c, g_s),
                                  float((lp_nc - sdpa.logprobs(tokens)).abs().max()),
                                  float((ent_c - ent).abs().max()))

    # The plan's parameter count (qurl/learner/memory_plan.py) vs the built model's, on this TP rank
    from qurl.learner.memory_plan import _params
    from qurl.models.convert import padded_vocab_size

    for kind in ("qwen2", "qwen3", "llama"):
        cfg = build(kind).config.to_dict()
        built = _learner(kind, ws).model
        out[f"{kind}/params"] = (sum(p.numel() for p in built.parameters()),
                                 _params(cfg, ws, padded_vocab_size(cfg["vocab_size"], ws))[0])

    # Which SDPA kernel runs: the fused flash kernel, never the math fallback.
    learner = _learner("qwen2", ws)
    learner.model.train()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _logp_and_grad(learner, tokens)
    out["ops"] = sorted({e.key for e in prof.key_averages() if "scaled_dot_product" in e.key
                         or e.key in ("aten::baddbmm", "aten::_softmax")})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    # TP 1, TP 2, then the plan job in one pair of processes (tests/spawn_in_turn.py); the plan
    # job goes last: it patches the learner module in the processes it runs in
    jobs = [(ws, ws, _worker, ()) for ws in (1, 2)] + [("plan", 2, _plan_worker, ())]
    return spawn_in_turn(jobs, tmp_path_factory.mktemp("runs-meet"))


TOL = 2e-5


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_sdpa_equals_unfused_attention(runs, ws: int, kind: str) -> None:
    for r in runs[ws]:
        lp, grad, logits = r[f"{kind}/fp32"]
        assert lp < TOL and grad < TOL and logits < TOL, (lp, grad, logits)
        bf_sdpa, bf_unfused = r[f"{kind}/bf16"]
        assert 0 < bf_sdpa <= 1.5 * bf_unfused, (bf_sdpa, bf_unfused)  # bf16 really ran


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_the_plan_counts_the_parameters_megatron_builds(runs, ws: int) -> None:
    for r in runs[ws]:
        for kind in ("qwen2", "qwen3", "llama"):  # biases + tied; q/k norms; untied
            built, planned = r[f"{kind}/params"]
            assert built == planned, (kind, built, planned)


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_sdpa_runs_the_fused_kernel_without_scores(runs, ws: int) -> None:
    ops = runs[ws][0]["ops"]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, ops
    assert not any("math" in op for op in ops) and "aten::baddbmm" not in ops, ops


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("how", ["selective", "full"])
def test_recompute_leaves_gradients_unchanged(runs, ws: int, how: str) -> None:
    # what megatron runs twice (forward, then again in the backward)
    twice = {"selective": {"core_attention", "mlp"}, "full": {"layer", "core_attention", "mlp"}}
    for r in runs[ws]:
        for kind in ("qwen2", "qwen3", "llama"):
            lp, grad, calls = r[f"{kind}/recompute/{how}"]
            assert lp < TOL and grad < TOL, (kind, lp, grad)
            assert r[f"{kind}/recompute/none"][2] == {"layer": 1, "core_attention": 1, "mlp": 1}
            assert calls == {k: 2 if k in twice[how] else 1 for k in calls}, calls


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_chunked_head_equals_the_whole_head(runs, ws: int) -> None:
    for r in runs[ws]:
        for kind in ("qwen2", "qwen3", "llama"):
            lp, grad, nograd, entropy = r[f"{kind}/chunked"]
            assert lp < TOL and grad < TOL and nograd < TOL and entropy < TOL, \
                (kind, lp, grad, nograd, entropy)


# ------------------------------------------------------------------ one plan for all ranks

def _plan_worker(rank: int, ws: int) -> dict:
    """TP 2 ranks whose 'GPU' reports very different free memory (rank 0 holds the sync arenas):
    count each rank's micro-batches in a train step and a no-grad log-prob pass."""
    import qurl.learner.megatron as lm
    from qurl.learner.dist import init_learner_dist
    from qurl.learner.membudget import rows_per_micro

    init_learner_dist(LearnerConfig(tp=ws), rank, ws)
    learner = _learner("qwen2", ws)
    cost = learner._token_cost
    # rank 0: room for ~1 row of width L; rank 1: for ~all of them
    own = int(cost.micro_bytes(1 if rank == 0 else B, L) / 0.8) + 1
    lm.free_bytes = lambda device: own  # what this rank's torch.cuda would report
    counted: list[int] = []
    real = lm.MegatronLearner._micro_batches

    def counting(self, *a, **k):
        parts = list(real(self, *a, **k))
        counted.append(len(parts))
        return iter(parts)

    lm.MegatronLearner._micro_batches = counting
    g = torch.Generator().manual_seed(5)
    tokens = _tokens(5)
    mask = torch.zeros(B, L)
    mask[:, 8:] = 1
    stats = learner.train_step(tokens, mask, -torch.rand(B, L, generator=g), torch.randn(B, generator=g))
    learner.logprobs(tokens)
    return {"counts": counted, "own_rows": rows_per_micro(L, cost, own, 0),
            "finite": all(v == v for k, v in stats.items() if k.startswith("grad_norm"))}


def test_ranks_with_different_free_memory_agree_on_one_plan(runs) -> None:
    r0, r1 = runs["plan"]
    assert r0["own_rows"] != r1["own_rows"]  # left to themselves they would split differently
    assert r0["counts"] == r1["counts"] and r0["finite"] and r1["finite"]
    # the agreed plan is the tighter rank's: one row per micro-batch
    assert r0["counts"][-1] == B, r0["counts"]
