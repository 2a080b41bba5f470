"""Qwen3-MoE into the learner: HF <-> Megatron round trips, the expert layouts, the router settings,
what is refused, and the learner's logits vs transformers' at TP 1 and TP 2 (real megatron-core
MoE layers on gloo, one spawned job per TP size, module-scoped).

Models are tiny (hidden 64, 2 layers, 8 experts of width 32, top-2, vocab 100; tests/tiny_hf.py).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from spawn_in_turn import spawn_in_turn
from tiny_hf import build_moe, hf_state, mixtral_config, qwen3_moe_config

from qurl.config import AlgoConfig, LearnerConfig, ModelConfig, OptimConfig
from qurl.models import convert, moe

LOGITS_TOL = 1e-4  # fp32, as the dense learner test; measured ~3e-6 at TP 1 and TP 2


def _disk_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as a checkpoint on disk holds it: per-expert names (save_pretrained's form)."""
    return moe.per_expert(hf_state(model))


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_exact_and_fused_experts_load_the_same(tp: int) -> None:
    model = build_moe()
    disk, fused = _disk_state(model), hf_state(model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused  # transformers 5 in memory
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in disk
    shards = [convert.hf_to_megatron(disk, model.config, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = convert.megatron_to_hf(shards, model.config)
    assert sorted(back) == sorted(disk)
    assert all(torch.equal(back[k], v) for k, v in disk.items())
    for r in range(tp):
        from_fused = convert.hf_to_megatron(fused, model.config, tp_rank=r, tp_size=tp)
        assert sorted(from_fused) == sorted(shards[r])
        assert all(torch.equal(from_fused[k], v) for k, v in shards[r].items())
    refused = moe.fused(back, model.config)
    assert all(torch.equal(refused[k], v) for k, v in fused.items())


def test_expert_layout_per_shard_and_partition_dims() -> None:
    model = build_moe()
    cfg, sd = model.config, _disk_state(model)
    inter = cfg.moe_intermediate_size
    for rank in range(2):
        meg = convert.hf_to_megatron(sd, cfg, tp_rank=rank, tp_size=2)
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        src, dst = "model.layers.1.mlp.", "decoder.layers.1.mlp."
        assert torch.equal(meg[dst + "experts.local_experts.5.linear_fc1.weight"],
                           torch.cat([sd[src + "experts.5.gate_proj.weight"][half],
                                      sd[src + "experts.5.up_proj.weight"][half]]))
        assert torch.equal(meg[dst + "experts.local_experts.5.linear_fc2.weight"],
                           sd[src + "experts.5.down_proj.weight"][:, half])
        assert torch.equal(meg[dst + "router.weight"], sd[src + "gate.weight"])  # whole on each rank
        assert not any(k.startswith(dst + "linear_fc") for k in meg)  # no dense MLP in a MoE layer
    assert convert.partition_dim("decoder.layers.0.mlp.router.weight") is None
    assert convert.partition_dim("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight") == 0
    assert convert.partition_dim("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight") == 1
    assert not convert.tp_partial_grad("decoder.layers.0.mlp.router.weight")


@pytest.mark.parametrize("norm", [True, False])
def test_router_settings_match_qwen3_moe(norm: bool) -> None:
    kw = convert.megatron_config_from_hf(qwen3_moe_config(norm_topk_prob=norm), tp=2,
                                         dtype=torch.float32)
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (8, 2, 32)
    assert kw["ffn_hidden_size"] == 32 and kw["qk_layernorm"] and not kw["add_qkv_bias"]
    # renormalised top-k of the softmax == softmax over the top-k logits (pre_softmax off)
    assert kw["moe_router_pre_softmax"] is (not norm)
    assert (kw["moe_router_score_function"], kw["moe_router_dtype"]) == ("softmax", "fp32")
    assert (kw["moe_aux_loss_coeff"], kw["moe_router_load_balancing_type"]) == (0.0, "none")
    assert (kw["moe_token_dispatcher_type"], kw["moe_grouped_gemm"]) == ("allgather", False)
    assert kw["moe_shared_expert_intermediate_size"] is None


@pytest.mark.parametrize("family,edit,named", [
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared experts"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": True}, "norm_topk_prob"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ("mixtral", {"num_experts_per_tok": 1}, "renormalised top-k"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_unsupported_moe_options_are_refused_in_one_line(family: str, edit: dict,
                                                          named: str) -> None:
    from qurl.errors import InputError
    from qurl.models.fits import check_architecture

    make = {"qwen3_moe": qwen3_moe_config, "mixtral": mixtral_config}[family]
    fields = dict(make().to_dict(), **edit)
    with pytest.raises(ValueError, match=named) as err:
        convert.check_supported(SimpleNamespace(**fields))
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match=named) as err:
        check_architecture(fields, "ck")
    assert "\n" not in str(err.value)


def test_other_moe_families_are_refused() -> None:
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM and MixtralForCausalLM only"):
        convert.check_supported(SimpleNamespace(**dict(
            qwen3_moe_config().to_dict(), architectures=["Qwen3ForCausalLM"], model_type="qwen3")))
    for arch in ("Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM"):  # Mixtral: test_moe_mixtral.py
        with pytest.raises(ValueError, match=arch):
            convert.check_supported(SimpleNamespace(architectures=[arch], model_type="x"))


def test_tiny_qwen3_moe_preset_builds_and_loads(tmp_path) -> None:
    from qurl.models.fits import check_architecture, check_learner_tp, read_fields
    from qurl.models.hf import build_model, check_checkpoint, load_checkpoint, read_state_dict

    out = build_model(tmp_path / "m", "tiny-qwen3-moe")
    cfg = check_checkpoint(out)
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    model, _ = load_checkpoint(out)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.norm_topk_prob
    sd = read_state_dict(out)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in sd
    shards = [convert.hf_to_megatron(sd, model.config, tp_rank=r, tp_size=2) for r in range(2)]
    back = convert.megatron_to_hf(shards, model.config)
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    fields = read_fields("tiny-qwen3-moe")
    check_architecture(fields, "tiny-qwen3-moe")
    check_learner_tp(fields, 2, "tiny-qwen3-moe")


# ------------------------------------------------------------------ the learner (spawned)


def _worker(rank: int, ws: int) -> dict:
    from qurl.learner.dist import init_learner_dist
    from qurl.learner.megatron import MegatronLearner

    init_learner_dist(LearnerConfig(tp=ws), rank, ws)
    out: dict = {}
    tokens = torch.randint(0, 100, (3, 10), generator=torch.Generator().manual_seed(1))
    for norm in (True, False):
        hf = build_moe(seed=3, norm_topk_prob=norm)
        learner = MegatronLearner(None, ModelConfig(dtype="float32"), AlgoConfig(uaq_scale=1.0),
                                  OptimConfig(), LearnerConfig(tp=ws), total_steps=1, seed=0,
                                  hf_state=hf_state(hf), hf_config=hf.config)
        logits = learner.logits(tokens).cpu()
        weights = {k: v.detach().cpu() for k, v in learner.named_weights()}
        if rank == 0:
            with torch.no_grad():
                ref = hf(tokens).logits
            want = _disk_state(hf)
            out[norm] = {"logits_diff": float((logits - ref).abs().max()),
                         "weights_exact": sorted(weights) == sorted(want) and all(
                             torch.equal(weights[k], v) for k, v in want.items())}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    # TP 1 then TP 2 in one pair of processes (tests/spawn_in_turn.py)
    return spawn_in_turn([(ws, ws, _worker, ()) for ws in (1, 2)],
                         tmp_path_factory.mktemp("runs-meet"))


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_learner_logits_match_transformers(runs, ws: int, norm: bool) -> None:
    res = runs[ws][0][norm]
    assert res["logits_diff"] <= LOGITS_TOL, res
    assert res["weights_exact"]  # named_weights: TP-gathered, per-expert HF names, bit-exact


@pytest.mark.parametrize("sets,named", [
    (["learner.tp=2"], "sequence parallelism"),
    (["rollout.engine=sglang", "sglang.urls=http://127.0.0.1:1"], "inside SGLang"),
    (["rollout.precision=w4a16"], "bf16, int8 or fp8"),
])
def test_what_a_moe_run_cannot_do_yet_is_refused_in_one_line(tmp_path, capsys, sets, named):
    """A Qwen3-MoE run at TP > 1, on SGLang, or at a precision the local engine's experts lack:
    `qurl train` says so in one line, exit 2, before any rank or run directory exists."""
    from qurl.cli import main

    argv = ["train", "--set", "model.base=tiny-qwen3-moe", "--set", f"deploy.dir={tmp_path / 'runs'}"]
    for s in sets:
        argv += ["--set", s]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "tiny-qwen3-moe" in err[0] and named in err[0]
    assert not (tmp_path / "runs").exists()


# The local engine, UAQ and the 8-bit export take a MoE now: tests/test_moe_engine.py,
# tests/test_moe_uaq.py, tests/test_moe_export.py (their former refusals were tested here).
