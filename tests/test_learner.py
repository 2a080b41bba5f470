"""The Megatron learner on CPU (gloo, real megatron-core): logits and log-probs vs transformers at
TP=1 and TP=2, one train step at TP=2 vs TP=1 vs a plain transformers + AdamW reference, UAQ keeps
the function, exact resume, bf16 masters, KL reference, data parallelism with and without the
sharded (ZeRO-1) optimizer vs one rank (and its expert groups at DP 4 x EP 2: expert-DP 2), and
the pure optimizer pieces.

The multi-process checks run in one spawned job per TP size (`_worker`), which returns numbers the
tests below assert on; models are tiny (hidden 64, 2 layers, vocab 100).
"""
from __future__ import annotations

import math
import shutil
import tempfile
import warnings
from dataclasses import replace

import pytest
import torch
from spawn_in_turn import spawn_in_turn
from tiny_hf import build, hf_state

from qurl.algo.loss import policy_loss
from qurl.config import (AlgoConfig, CorrectionConfig, LearnerConfig, ModelConfig,
                         OptimConfig, RanksDeployConfig)
from qurl.learner import optim as lopt

ALGO = AlgoConfig(loss="acr", mini_batches=2, epochs=1, uaq_scale=1.0, clip=(0.2, 0.2),
                  correction=CorrectionConfig(cap=2.0))
OPTIM = OptimConfig(lr=1e-3, grad_clip=1.0, weight_decay=0.01)
B, L, PROMPT = 8, 12, 4


def _hf_logp(model: torch.nn.Module, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logits = model(tokens).logits[:, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return torch.cat([lp.new_zeros(tokens.shape[0], 1), lp], dim=1)


def _batch(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded responses after a 4-token prompt; behav = reference logp + noise (so IS weights
    get truncated); mostly positive advantages (so the loss does not cancel to ~0)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 100, (B, L), generator=g)
    lengths = torch.randint(3, L - PROMPT + 1, (B,), generator=g)
    mask = torch.zeros(B, L)
    for i, n in enumerate(lengths.tolist()):
        mask[i, PROMPT:PROMPT + n] = 1
        tokens[i, PROMPT + n:] = 0  # pad id
    with torch.no_grad():
        behav = _hf_logp(model, tokens) + 0.3 * torch.randn(B, L, generator=g)
    adv = torch.randn(B, generator=g) + 1.0
    staleness = torch.randint(0, 3, (B,), generator=g)  # versions behind: stats split by it
    return {"tokens": tokens, "loss_mask": mask, "behav_logp": behav, "adv": adv, "staleness": staleness}


def _learner(kind: str, ws: int, algo: AlgoConfig = ALGO, dtype: str = "float32", **kw):
    from qurl.learner.megatron import MegatronLearner

    model = build(kind)
    return MegatronLearner(None, ModelConfig(dtype=dtype), algo, OPTIM, LearnerConfig(tp=ws),
                           total_steps=4, seed=0, hf_state=hf_state(model), hf_config=model.config, **kw)


def _step(learner, batch: dict) -> dict[str, float]:
    return learner.train_step(batch["tokens"], batch["loss_mask"], batch["behav_logp"], batch["adv"],
                              staleness=batch["staleness"])


def _weights(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in learner.named_weights()}


def _norms_vs_transformers(model: torch.nn.Module, hf: torch.nn.Module) -> dict:
    """The bf16 learner's RMSNorms against transformers' RMSNorm of the same family holding the
    same gain in bf16 (as a bf16 checkpoint loads it), and both against float64, on bf16
    activations: the gain dtypes and the worst error of each, in units of the bf16 spacing at the
    float64 value (2^(floor(log2|ref|) - 7))."""
    norm_cls = type(hf.model.norm)
    gains = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    x = (3 * torch.randn(6, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
         ).to(torch.bfloat16)
    worst = {"learner": 0.0, "transformers": 0.0}
    for norm in gains:
        ref_norm = norm_cls(hf.config.hidden_size, eps=norm.eps).to(torch.bfloat16)
        with torch.no_grad():
            ref_norm.weight.copy_(norm.weight)
            x64 = x.double()
            exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
            ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
            for who, y in (("learner", norm(x)), ("transformers", ref_norm(x))):
                assert y.dtype == torch.bfloat16
                worst[who] = max(worst[who], float(((y.double() - exact).abs() / ulp).max()))
    return {"count": len(gains), "gain_dtypes": sorted({str(m.weight.dtype) for m in gains}),
            "ulps": worst}


def _worker(rank: int, ws: int) -> dict:
    from qurl.learner.dist import broadcast_object, init_learner_dist
    from qurl.quant.uaq import apply_uaq

    init_learner_dist(LearnerConfig(tp=ws), rank, ws)
    out: dict = {}
    for kind in ("qwen2", "qwen3", "llama"):
        hf = build(kind)
        tokens = torch.randint(0, 100, (3, 10), generator=torch.Generator().manual_seed(1))
        learner = _learner(kind, ws)
        logits, lp07 = learner.logits(tokens).cpu(), learner.logprobs(tokens, temperature=0.7).cpu()
        weights = _weights(learner)
        batch = _batch(hf, seed=2)
        res = {"stats": _step(learner, batch), "batch": batch}
        res["after"] = _weights(learner)  # rank 0's: the full (TP-gathered) weights
        if rank == 0:
            with torch.no_grad():
                res["logits_diff"] = float((logits - hf(tokens).logits).abs().max())
                res["logp_t07_diff"] = float((lp07 - _hf_logp(hf, tokens, 0.7)).abs().max())
            ref = hf_state(hf)
            res["weights_exact"] = sorted(weights) == sorted(ref) and all(
                torch.equal(weights[k], ref[k]) for k in ref)
        out[kind] = res

    # UAQ: master weights are the scaled ones; the function is unchanged.
    hf = build("qwen2")
    tokens = torch.randint(0, 100, (3, 10), generator=torch.Generator().manual_seed(3))
    learner = _learner("qwen2", ws, algo=replace(ALGO, uaq_scale=1.5))
    logits, weights = learner.logits(tokens).cpu(), _weights(learner)
    if rank == 0:
        scaled = apply_uaq(hf_state(hf), 1.5)
        with torch.no_grad():
            out["uaq_logits_diff"] = float((logits - hf(tokens).logits).abs().max())
        out["uaq_weights_exact"] = all(torch.equal(weights[k], scaled[k]) for k in scaled)
        out["uaq_changed"] = not torch.equal(scaled["model.layers.0.self_attn.q_proj.weight"],
                                             hf_state(hf)["model.layers.0.self_attn.q_proj.weight"])

    # Exact resume: step, save, step  vs  load, step.
    b1, b2 = _batch(hf, seed=4), _batch(hf, seed=5)
    a = _learner("qwen2", ws, algo=replace(ALGO, uaq_scale=1.5))
    _step(a, b1)
    ckpt = broadcast_object(tempfile.mkdtemp(prefix="qurl-learner-") if rank == 0 else None)
    a.save(ckpt)
    broadcast_object(None)  # every shard written
    stats_a, weights_a = _step(a, b2), _weights(a)
    fresh = _learner("qwen2", ws, algo=replace(ALGO, uaq_scale=1.5))
    fresh.load(ckpt)
    stats_b, weights_b = _step(fresh, b2), _weights(fresh)
    out["resume_stats_equal"] = stats_a == stats_b
    out["resume_weights_equal"] = all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    out["resume_step"] = fresh.step
    out["resume_moved"] = any(not torch.equal(weights_a[k], weights[k]) for k in weights_a)
    # A checkpoint written under Transformer Engine names (fused norm gains) loads into the local spec.
    from qurl.models.convert import to_te_names

    state = a.state_dict()
    out["saved_local_names"] = not any("layer_norm_weight" in k for k in state["model"])
    state["model"] = to_te_names(state["model"])
    out["te_named"] = any("layer_norm_weight" in k for k in state["model"])
    from_te = _learner("qwen2", ws, algo=replace(ALGO, uaq_scale=1.5))
    from_te.load_state_dict(state)
    want = a.model.state_dict()
    out["te_checkpoint_loads"] = all(torch.equal(want[k], v) for k, v in
                                     from_te.model.state_dict().items() if isinstance(v, torch.Tensor))
    broadcast_object(None)  # every rank has loaded before the directory goes
    if rank == 0:
        shutil.rmtree(ckpt)

    from megatron_patches.cpu import apply_cpu_patches

    out["patches_again"] = apply_cpu_patches()  # idempotent; active on this CUDA-less machine
    out["current_device"] = str(torch.cuda.current_device())

    if ws == 1:  # single-rank extras
        import qurl.learner.megatron as lm
        from qurl.learner.megatron import MegatronLearner

        # One row per micro-batch (each row cut at its last loss token) vs whole mini-batches.
        budget, lm.LOGITS_BUDGET = lm.LOGITS_BUDGET, 1
        try:
            out["per_row_stats"] = _step(_learner("qwen2", ws), out["qwen2"]["batch"])
        finally:
            lm.LOGITS_BUDGET = budget

        model_dir = tempfile.mkdtemp(prefix="qurl-hf-")
        hf.save_pretrained(model_dir)  # safetensors; tied lm_head not stored
        from_dir = MegatronLearner(model_dir, ModelConfig(), ALGO, OPTIM, LearnerConfig(tp=1),
                                   total_steps=1, seed=0)
        loaded = _weights(from_dir)
        shutil.rmtree(model_dir)
        out["from_dir_exact"] = sorted(loaded) == sorted(hf_state(hf)) and all(
            torch.equal(loaded[k], v) for k, v in hf_state(hf).items())
        bf = _learner("qwen2", ws, dtype="bfloat16")
        bf_init = _weights(bf)  # masters before any step: the fp32 checkpoint, not its bf16 copy
        out["bf16_masters_exact"] = sorted(bf_init) == sorted(hf_state(hf)) and all(
            torch.equal(bf_init[k], v) for k, v in hf_state(hf).items())
        out["bf16_model_rounded"] = any(p.dtype == torch.bfloat16 for p in bf.model.parameters())
        batch = _batch(hf, seed=6)
        with torch.no_grad():
            ref_lp = _hf_logp(hf, batch["tokens"])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out["bf16_logp_diff"] = float((bf.logprobs(batch["tokens"]).cpu() - ref_lp).abs().max())
        out["bf16_forward_warnings"] = sorted({str(w.message)[:80] for w in seen})
        out["bf16_norms"] = _norms_vs_transformers(bf.model, hf)
        out["bf16_stats"] = _step(bf, batch)
        out["bf16_master_dtypes"] = {str(t.dtype) for _, t in bf.named_weights()}
        # The head on the loss columns only (qurl/learner/logits.py): from column 5 on the same
        # log-probs as the whole head's, before it zeros; gradients equal through the cut
        cut_l = _learner("qwen2", ws)
        toks = batch["tokens"].to(cut_l.device)  # the private forward takes them where the model is
        full = cut_l._forward_logp(cut_l.model, toks, 1.0)[0]
        part = cut_l._forward_logp(cut_l.model, toks, 1.0, start=5)[0]
        out["head_cut"] = (float((part[:, 5:] - full[:, 5:]).abs().max()),
                           float(part[:, :5].abs().max()), float(full[:, 1:5].abs().min()))
        grads = []
        for lp in (full[:, 5:].sum(), part[:, 5:].sum()):
            cut_l.model.zero_grad(set_to_none=True)
            lp.backward()
            grads.append(torch.cat([p.grad.flatten() for p in cut_l.model.parameters()]))
        out["head_cut_grad"] = float((grads[0] - grads[1]).abs().max() / grads[0].abs().max())
        kl = _learner("qwen2", ws, algo=replace(ALGO, kl_coef=0.1))
        before = kl.logprobs(batch["tokens"])
        out["kl_stats"] = [_step(kl, batch) for _ in range(2)]
        out["kl_ref_frozen"] = torch.equal(kl._logprobs(kl.ref_model, batch["tokens"], 1.0)[0], before)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    return spawn_in_turn([(ws, ws, _worker, ()) for ws in (1, 2)],
                          tmp_path_factory.mktemp("runs-meet"))


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_logits_and_logprobs_match_transformers(runs, ws: int, kind: str) -> None:
    res = runs[ws][0][kind]
    assert res["logits_diff"] <= 1e-4
    assert res["logp_t07_diff"] <= 1e-4
    assert res["weights_exact"]  # named_weights: TP-gathered HF names, bit-exact


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_train_step_tp2_equals_tp1(runs, kind: str) -> None:
    s1, s2 = runs[1][0][kind]["stats"], runs[2][0][kind]["stats"]
    assert runs[2][1][kind]["stats"] == s2  # both ranks report the same numbers
    for key in ("loss", "grad_norm", "grad_norm_last"):
        assert abs(s1[key] - s2[key]) <= 1e-5 * abs(s1[key]), key
    assert s1["tokens"] == s2["tokens"] == float(runs[1][0][kind]["batch"]["loss_mask"].sum())
    assert s1["skipped_updates"] == 0
    assert {"is_ratio_mean/s0", "acr_widened_frac"} <= set(s1) and s1["acr_widened_frac"] > 0
    # the updated weights too: a replicated gain whose TP gradient were left partial (Qwen3's
    # q/k norms) would move differently at TP 2 (an AdamW step moves a weight by up to ~lr; where a
    # gradient is near AdamW's eps, summation order alone can move it a little differently)
    w1, w2 = runs[1][0][kind]["after"], runs[2][0][kind]["after"]
    assert sorted(w1) == sorted(w2)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=OPTIM.lr / 10, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_entropy_of_the_proximal_policy_matches_a_float64_reference(runs, ws: int, kind: str) -> None:
    """train_step's `entropy`: the mean over loss tokens of -sum p log p of π_prox (the weights
    before the step) at each sampled position, vs transformers in float64 (tolerance 1e-5)."""
    batch = runs[ws][0][kind]["batch"]
    model = build(kind).double()
    with torch.no_grad():
        logp = torch.log_softmax(model(batch["tokens"]).logits[:, :-1], -1)
    ent = -(logp.exp() * logp).sum(-1)  # [B, L-1]: the distribution of column j + 1
    mask = batch["loss_mask"][:, 1:].double()
    want = float((ent * mask).sum() / mask.sum())
    for r in runs[ws]:  # every rank reports it
        assert r[kind]["stats"]["entropy"] == pytest.approx(want, abs=1e-5)
    assert want > 0.5  # far from a one-hot distribution: the test can fail


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_train_step_matches_transformers_adamw_reference(runs, kind: str) -> None:
    """Same step by hand: HF model, prox once, 2 mini-batches of policy_loss, global-norm clip, AdamW."""
    batch, stats = runs[1][0][kind]["batch"], runs[1][0][kind]["stats"]
    model = build(kind)
    params = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": 0.01},
                             {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=OPTIM.lr, betas=tuple(OPTIM.adam[:2]), eps=OPTIM.adam[2])
    with torch.no_grad():
        prox = _hf_logp(model, batch["tokens"])
    losses, norms, mb = [], [], B // 2
    for i in range(2):
        sl = slice(i * mb, (i + 1) * mb)
        loss, _ = policy_loss(_hf_logp(model, batch["tokens"][sl]), prox[sl], batch["behav_logp"][sl],
                              batch["adv"][sl], batch["loss_mask"][sl], preset="acr", eps_low=0.2,
                              eps_high=0.2, tis_cap=2.0, agg=ALGO.agg)
        opt.zero_grad()
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for _, p in params))
        torch.nn.utils.clip_grad_norm_([p for _, p in params], OPTIM.grad_clip)  # same rule
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(norm)
    assert stats["loss"] == pytest.approx(sum(losses) / 2, rel=1e-4)
    assert stats["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-4)
    assert stats["grad_norm_last"] == pytest.approx(norms[-1], rel=1e-4)
    assert norms[0] > OPTIM.grad_clip  # clipping was exercised


@pytest.mark.slow
def test_length_sorted_per_row_micro_batches_equal_whole_mini_batches(runs) -> None:
    """Rows of 4..11 tokens: computed one per micro-batch, each only up to its last loss token,
    the step's loss and gradient norms equal the one-micro-batch step's (float rounding only)."""
    whole, per_row = runs[1][0]["qwen2"]["stats"], runs[1][0]["per_row_stats"]
    for key in ("loss", "grad_norm", "grad_norm_last", "is_ratio_mean", "kl_behav_prox"):
        assert per_row[key] == pytest.approx(whole[key], rel=1e-5), key


@pytest.mark.slow
def test_head_on_loss_columns_only_equals_the_whole_head(runs) -> None:
    """_forward_logp(start=5) computes the head from position 4 on: the same log-probs from
    column 5 (float rounding of a smaller GEMM), exact zeros before it (where the whole head
    gives real, non-zero log-probs), and the same gradient."""
    same, before, real = runs[1][0]["head_cut"]
    assert same <= 1e-5 and before == 0.0 and real > 0.0
    assert runs[1][0]["head_cut_grad"] <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_uaq_preserves_function_and_scales_master_weights(runs, ws: int) -> None:
    res = runs[ws][0]
    assert res["uaq_changed"] and res["uaq_weights_exact"]
    assert res["uaq_logits_diff"] <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_save_load_resume_is_bit_exact(runs, ws: int) -> None:
    for rank in range(ws):
        res = runs[ws][rank]
        assert res["resume_stats_equal"] and res["resume_step"] == 2
    assert runs[ws][0]["resume_weights_equal"] and runs[ws][0]["resume_moved"]
    for rank in range(ws):  # checkpoints hold local-spec names; TE-named ones load too
        res = runs[ws][rank]
        assert res["saved_local_names"] and res["te_named"] and res["te_checkpoint_loads"]


@pytest.mark.slow
def test_cpu_patches_are_idempotent(runs) -> None:
    for ws in (1, 2):
        assert runs[ws][0]["patches_again"] == {"current_device": True, "rng_tracker": True}
        assert runs[ws][0]["current_device"] == "cpu"


@pytest.mark.slow
def test_bf16_norms_hold_bf16_gains_and_match_transformers(runs) -> None:
    """Every RMSNorm of the bf16 learner holds its gain in bf16, as transformers' Qwen2RMSNorm
    does for a bf16 checkpoint, so torch's fused rms_norm runs (no dtype-mismatch warning in the
    forward). Tolerance, in bf16 spacings at the float64 value: the fused kernel computes in fp32
    and rounds once (<= 0.5, +0.01 for its fp32 arithmetic); transformers rounds the normalised
    value to bf16 before the gain (<= 1.5); the learner is never the further of the two."""
    res = runs[1][0]
    norms = res["bf16_norms"]
    assert norms["count"] == 2 * 2 + 1 and norms["gain_dtypes"] == ["torch.bfloat16"]
    assert norms["ulps"]["learner"] <= 0.51, norms
    assert norms["ulps"]["transformers"] <= 1.5, norms
    assert norms["ulps"]["learner"] <= norms["ulps"]["transformers"], norms
    assert not [w for w in res["bf16_forward_warnings"] if "dtype" in w], res["bf16_forward_warnings"]


def test_bf16_keeps_fp32_masters_and_kl_reference_is_frozen(runs) -> None:
    res = runs[1][0]
    assert res["bf16_logp_diff"] < 0.15  # bf16 forward vs fp32 reference
    assert math.isfinite(res["bf16_stats"]["loss"]) and res["bf16_stats"]["skipped_updates"] == 0
    assert res["bf16_master_dtypes"] == {"torch.float32"}
    assert res["bf16_model_rounded"] and res["bf16_masters_exact"]
    assert res["from_dir_exact"]  # learner built from a save_pretrained directory
    first, second = res["kl_stats"]
    assert first["kl_ref"] >= 0 and second["kl_ref"] > first["kl_ref"]  # policy drifts from ref
    assert res["kl_ref_frozen"]


# ---------------------------------------------------------------- data parallelism


def _dp_worker(rank: int, ws: int, tp: int, dp: int, distributed: bool, dtype: str) -> dict:
    """Two steps with learner.tp=tp, learner.dp=dp, then exact resume."""
    from qurl.learner.dist import broadcast_object, init_learner_dist

    lc, dc = LearnerConfig(tp=tp, dp=dp), RanksDeployConfig(distributed_optimizer=distributed)
    init_learner_dist(lc, rank, ws)
    hf = build("qwen2")

    def make():
        from qurl.learner.megatron import MegatronLearner

        return MegatronLearner(None, ModelConfig(dtype=dtype), ALGO, OPTIM, lc, total_steps=4,
                               seed=0, ranks=dc, hf_state=hf_state(hf), hf_config=hf.config)

    a = make()
    b1, b2 = _batch(hf, seed=2), _batch(hf, seed=3)
    out = {"stats1": _step(a, b1), "master_numel": a.optimizer.master_numel()}
    ckpt = broadcast_object(tempfile.mkdtemp(prefix="qurl-dp-") if rank == 0 else None)
    a.save(ckpt)
    broadcast_object(None)
    out["stats2"], weights = _step(a, b2), _weights(a)
    fresh = make()
    fresh.load(ckpt)
    out["resume_stats_equal"] = _step(fresh, b2) == out["stats2"]
    resumed = _weights(fresh)
    out["resume_weights_equal"] = all(torch.equal(weights[k], resumed[k]) for k in weights)
    broadcast_object(None)
    if rank == 0:
        out["weights"] = weights
        out["files"] = sorted(p.name for p in __import__("pathlib").Path(ckpt).iterdir())
        shutil.rmtree(ckpt)
    return out


def _optim_worker(rank: int, ws: int) -> dict:
    """DP 4 with EP 2 (expert-DP 2), the optimizer alone on megatron's groups: two dense tensors
    (the same on every rank) and this EP rank's expert, each rank with gradients of its own; one
    clipped AdamW step with the masters sharded (dense over DP 4, the expert over expert-DP 2),
    and one with them replicated."""
    from megatron.core import parallel_state as ps

    from qurl.learner.dist import init_learner_dist
    from qurl.learner.distopt import DistributedAdamW, Parallel

    init_learner_dist(LearnerConfig(dp=4, ep=2), rank, ws)
    ep_rank = ps.get_expert_model_parallel_rank()
    par = Parallel(0, 1, None, ps.get_data_parallel_rank(), 4, ps.get_data_parallel_group(), 2,
                   ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_rank(), 2,
                   ps.get_expert_data_parallel_group())
    out = {"ep_rank": ep_rank}
    for distributed in (True, False):
        dense, experts = _optim_tensors()
        params = [torch.nn.Parameter(t.clone()) for t in (*dense, experts[ep_rank])]
        for p, g in zip(params, _optim_grads(rank)):
            p.grad = g
        opt = DistributedAdamW(params, [True] * 3, OPTIM, par, distributed=distributed,
                               expert=[False, False, True])
        norm = opt.step(max_norm=0.5)
        out[distributed] = {"norm": norm, "masters": opt.full_masters(),
                            "numel": opt.master_numel()}
    return out


def _optim_tensors() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return ([torch.randn(6, 3, generator=g), torch.randn(5, generator=g)],
            [torch.randn(4, 3, generator=g) for _ in range(2)])  # experts 0, 1


def _optim_grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(6, 3, generator=g), torch.randn(5, generator=g), torch.randn(4, 3, generator=g)]


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory) -> dict[tuple, list[dict]]:
    layouts = [(1, 1, False, "float32"), (1, 2, False, "float32"), (1, 2, True, "float32"),
               (2, 2, True, "float32"), (1, 2, True, "bfloat16")]
    jobs = [(lay, lay[0] * lay[1], _dp_worker, lay) for lay in layouts]
    return spawn_in_turn(jobs + [("ep-optim", 4, _optim_worker, ())],
                         tmp_path_factory.mktemp("dp-meet"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(1, 2, False, "float32"), (1, 2, True, "float32"),
                                    (2, 2, True, "float32")])
def test_data_parallel_step_equals_single_rank(dp_runs, layout: tuple) -> None:
    """Each DP rank computes half of every mini-batch; summed grads = the one-rank gradient (fp32:
    bf16 forwards of different row groupings differ by ~1e-3)."""
    ref, got = dp_runs[(1, 1, False, "float32")][0], dp_runs[layout]
    for rank_out in got[1:]:
        assert rank_out["stats1"] == got[0]["stats1"]  # every rank reports the same numbers
    for step in ("stats1", "stats2"):
        for key in ("loss", "grad_norm", "grad_norm_last", "is_ratio_mean", "clip_frac_high",
                    "acr_widened_frac"):
            assert got[0][step][key] == pytest.approx(ref[step][key], rel=1e-5, abs=1e-9), (step, key)
    assert got[0]["stats1"]["skipped_updates"] == 0 and got[0]["stats1"]["grad_norm"] > OPTIM.grad_clip
    # After two AdamW steps (updates ~lr = 1e-3): measured ≤ 4e-7 apart, except k_proj.bias at
    # up to 1.1e-5 (tp 2 x dp 2): its gradient is tiny — softmax is nearly shift-invariant in
    # it — and Adam divides the rounding noise of differently shaped micro-batches by that scale.
    for k, w in ref["weights"].items():
        tol = 5e-5 if "k_proj.bias" in k else 1e-5
        assert torch.allclose(got[0]["weights"][k], w, rtol=0, atol=tol), k
    moved = max(float((ref["weights"][k] - v).abs().max()) for k, v in hf_state(build("qwen2")).items())
    assert moved > 1e-4  # the steps did change the weights (lr 1e-3)


@pytest.mark.slow
def test_distributed_optimizer_shards_masters_and_resumes_exactly(dp_runs) -> None:
    full = dp_runs[(1, 1, False, "float32")][0]["master_numel"]
    replicated = [r["master_numel"] for r in dp_runs[(1, 2, False, "float32")]]
    sharded = [r["master_numel"] for r in dp_runs[(1, 2, True, "float32")]]
    assert replicated == [full, full]
    assert sum(sharded) - full < 2 * 2 and max(sharded) <= full // 2 + 2  # halves (+ padding)
    assert [r["master_numel"] for r in dp_runs[(1, 2, True, "bfloat16")]] == sharded
    tp2 = [r["master_numel"] for r in dp_runs[(2, 2, True, "float32")]]
    assert max(tp2) < full // 3  # TP halves the shard, DP halves it again (replicated norms stay)
    for layout, outs in dp_runs.items():  # bf16 model + sharded fp32 masters included
        if layout == "ep-optim":
            continue  # the optimizer alone (test_expert_gradients_are_summed_...)
        assert all(r["resume_stats_equal"] and r["resume_weights_equal"] for r in outs), layout
    assert dp_runs[(1, 2, True, "float32")][0]["files"] == ["model_rank0.pt", "optim_rank0_dp0.pt",
                                                   "optim_rank0_dp1.pt"]


@pytest.mark.slow
def test_expert_gradients_are_summed_and_sharded_over_expert_data_parallel(dp_runs) -> None:
    """DP 4 x EP 2 against one rank holding everything: dense gradients summed over the 4 ranks,
    expert e's over the 2 ranks holding it; the norm over all of it (rel 1e-6) and the updated
    masters (within 1e-6): fp32 gradient sums in another order; the expert masters halved."""
    from qurl.learner.distopt import DistributedAdamW

    got = dp_runs["ep-optim"]
    dense, experts = _optim_tensors()
    params = [torch.nn.Parameter(t.clone()) for t in (*dense, *experts)]
    grads = [_optim_grads(r) for r in range(4)]
    for i in range(2):
        params[i].grad = sum(g[i] for g in grads)
    for e in range(2):
        params[2 + e].grad = sum(g[2] for g, out in zip(grads, got) if out["ep_rank"] == e)
    assert sorted(out["ep_rank"] for out in got) == [0, 0, 1, 1]
    ref = DistributedAdamW(params, [True] * 4, OPTIM)
    norm = ref.step(max_norm=0.5)
    want = ref.full_masters()
    assert norm > 0.5  # the clip binds
    for out in got:
        for distributed in (True, False):
            res = out[distributed]
            assert res["norm"] == pytest.approx(norm, rel=1e-6), distributed
            for m, w in zip(res["masters"], want[:2] + [want[2 + out["ep_rank"]]]):
                torch.testing.assert_close(m, w, rtol=0, atol=1e-6)
        # sharded, each group padded to a multiple of its ranks: dense 18 -> 20 and 5 -> 8 over
        # DP 4, the expert's 12 over expert-DP 2; replicated, all 18 + 5 + 12
        assert out[True]["numel"] == 20 // 4 + 8 // 4 + 12 // 2 and out[False]["numel"] == 35


# ---------------------------------------------------------------- pure pieces (no processes)


def test_lr_schedule() -> None:
    o = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine")
    assert [lopt.lr_at(o, k, 6) for k in range(2)] == [0.5, 1.0]
    assert lopt.lr_at(o, 2, 6) == 1.0
    assert lopt.lr_at(o, 4, 6) == pytest.approx(0.5)  # halfway through the decay
    assert lopt.lr_at(o, 6, 6) == pytest.approx(0.0, abs=1e-12)
    assert lopt.lr_at(replace(o, schedule="constant"), 5, 6) == 1.0


def test_flat_adamw_single_rank_matches_torch_adamw() -> None:
    """DistributedAdamW with one rank: grad norm over counted params only, megatron's clip rule,
    then exactly torch's AdamW (decay on matrices only) on fp32 masters, published into bf16."""
    from qurl.learner.distopt import DistributedAdamW

    g = torch.Generator().manual_seed(0)
    init = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g), torch.randn(2, 2, generator=g)]
    grads = [torch.randn(t.shape, generator=g) for t in init]
    params = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in init]
    opt = DistributedAdamW(params, [True, False, True], OPTIM)
    for p, gr in zip(params, grads):
        p.grad = gr.to(torch.bfloat16)
    bf_grads = [p.grad.float() for p in params]
    norm = opt.step(max_norm=1.0)
    # The vector is "replicated on another TP rank": not counted here.
    expect = math.sqrt(sum(float(bf_grads[i].double().pow(2).sum()) for i in (0, 2)))
    assert norm == pytest.approx(expect, rel=1e-12)
    ref = [torch.nn.Parameter(t.to(torch.bfloat16).float()) for t in init]
    ropt = torch.optim.AdamW([{"params": [ref[0], ref[2]], "weight_decay": OPTIM.weight_decay},
                              {"params": [ref[1]], "weight_decay": 0.0}], lr=OPTIM.lr)
    coeff = 1.0 / (expect + 1e-6)
    for r, gr in zip(ref, bf_grads):
        r.grad = gr * coeff
    ropt.step()
    masters = opt.full_masters()
    for m, r, p in zip(masters, ref, params):
        assert m.dtype == torch.float32 and torch.allclose(m, r.detach(), rtol=0, atol=1e-7)
        assert torch.equal(p.detach(), m.to(torch.bfloat16))  # published into the model
    assert all(p.grad is None for p in params)
    assert opt.master_numel() == sum(t.numel() for t in init)
    for p in params:  # a non-finite norm skips the update
        p.grad = torch.full_like(p, float("nan"))
    assert math.isnan(opt.step(max_norm=1.0))
    assert all(torch.equal(a, b) for a, b in zip(opt.full_masters(), masters))


def test_grad_norm_sum_spans_chunks() -> None:
    """The CPU grad norm sums squares chunk by chunk through an fp64 scratch: over several chunks
    plus a remainder it equals the float64 sum (to fp64 rounding), and inf/NaN anywhere survive."""
    from qurl.learner import distopt

    opt = distopt.DistributedAdamW([torch.nn.Parameter(torch.zeros(2, 2))], [True], OPTIM)
    n = 2 * distopt._NORM_CHUNK + 1234
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e3
    got = float(opt._sum_squares_f64(x))
    assert got == pytest.approx(float(x.double().pow(2).sum()), rel=1e-13)
    for pos, bad in ((n - 1, float("inf")), (distopt._NORM_CHUNK, float("nan"))):
        y = x.clone()
        y[pos] = bad
        assert not math.isfinite(float(opt._sum_squares_f64(y)))
