"""Mixtral into the learner, and the MoE derived from a dense Llama (issue 67 item 1).

- HF <-> Megatron round trips of a Mixtral checkpoint (its `block_sparse_moe.…w1/w3/w2` names, or
  transformers 5's fused in-memory form), the router settings, what is refused in one line;
- the learner's logits vs transformers' `MixtralForCausalLM` at TP 1 and TP 2 (real megatron-core
  MoE layers on gloo, TP 1 then TP 2 in one spawned pair of processes, module-scoped);
- qurl/models/moe_from_dense.py: with every expert active and a zero router the derived Mixtral's
  logits equal the dense Llama's (fp32, DENSE_TOL), on a tiny Llama and on one real SmolLM2-135M
  MLP (skipped when not fetched); with its seeded router (method "blocks") and top-k < E it is
  another model, whose routing depends on the token. The calibrated method "cluster":
  tests/test_moe_calibrate.py.

Models are tiny (hidden 64, 2 layers, 8 experts of width 32, top-2, vocab 100; tests/tiny_hf.py).
"""
from __future__ import annotations

import json

import pytest
import torch
from spawn_in_turn import spawn_in_turn
from tiny_hf import build_mixtral, hf_state, load_eager, mixtral_config, save_llama

from qurl.config import AlgoConfig, LearnerConfig, ModelConfig, OptimConfig
from qurl.models import convert, moe

LOGITS_TOL = 1e-4  # fp32 learner vs transformers, as tests/test_moe_convert.py
# derived MoE (k = E, zero router) vs the dense model, fp32: the same sums in another order
# (8 partial down projections, each x E then x 1/E); measured ~1e-6 on the tiny Llama, 4.4e-5 on
# SmolLM2-135M's logits (|logits| up to 30)
DENSE_TOL = 1e-4


def _disk(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as a Mixtral checkpoint holds it (save_pretrained's names)."""
    return moe.to_disk(moe.per_expert(hf_state(model)), model.config)


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_exact_from_mixtral_names_and_fused(tp: int) -> None:
    model = build_mixtral()
    disk, fused = _disk(model), hf_state(model)
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in disk
    assert "model.layers.0.block_sparse_moe.gate.weight" in disk
    assert not any(".mlp." in k for k in disk)
    shards = [convert.hf_to_megatron(disk, model.config, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = convert.megatron_to_hf(shards, model.config)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in back  # qurl's own names
    on_disk = moe.to_disk(back, model.config)
    assert sorted(on_disk) == sorted(disk) and all(torch.equal(on_disk[k], v) for k, v in disk.items())
    for r in range(tp):
        from_fused = convert.hf_to_megatron(fused, model.config, tp_rank=r, tp_size=tp)
        assert sorted(from_fused) == sorted(shards[r])
        assert all(torch.equal(from_fused[k], v) for k, v in shards[r].items())
    # w1 is gate, w3 up, w2 down (transformers' conversion_mapping "mixtral")
    e3 = fused["model.layers.0.mlp.experts.gate_up_proj"][3]
    assert torch.equal(disk["model.layers.0.block_sparse_moe.experts.3.w1.weight"], e3[:32])
    assert torch.equal(disk["model.layers.0.block_sparse_moe.experts.3.w3.weight"], e3[32:])


def test_save_pretrained_writes_the_names_to_disk_maps_to(tmp_path) -> None:
    from qurl.models.hf import read_state_dict

    model = build_mixtral()
    model.save_pretrained(tmp_path)
    saved = read_state_dict(tmp_path)
    assert sorted(saved) == sorted(_disk(model))


def test_router_settings_match_mixtral() -> None:
    cfg = mixtral_config()
    kw = convert.megatron_config_from_hf(cfg, tp=2, dtype=torch.float32)
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"]) == (8, 2, 32)
    assert kw["ffn_hidden_size"] == 32 and kw["kv_channels"] == 32
    assert not kw["qk_layernorm"] and not kw["add_qkv_bias"]  # Llama's attention
    assert kw["moe_router_pre_softmax"] is False  # Mixtral always renormalises its top-k
    assert moe.route_shape(cfg.to_dict()) == (2, 2, 8)


# ------------------------------------------------------------------ the learner (spawned)


def _worker(rank: int, ws: int) -> dict:
    from qurl.learner.dist import init_learner_dist
    from qurl.learner.megatron import MegatronLearner

    init_learner_dist(LearnerConfig(tp=ws), rank, ws)
    tokens = torch.randint(0, 100, (3, 10), generator=torch.Generator().manual_seed(1))
    hf = build_mixtral(seed=3)
    out: dict = {}
    for uaq in (1.0, 1.5):  # UAQ (norm x s, router and gate/up / s) keeps the function
        learner = MegatronLearner(None, ModelConfig(dtype="float32"), AlgoConfig(uaq_scale=uaq),
                                  OptimConfig(), LearnerConfig(tp=ws), total_steps=1, seed=0,
                                  hf_state=_disk(hf), hf_config=hf.config)  # Mixtral's names
        logits = learner.logits(tokens).cpu()
        weights = {k: v.detach().cpu() for k, v in learner.named_weights()}
        if rank:
            continue
        with torch.no_grad():
            ref = hf(tokens).logits
        want = moe.per_expert(hf_state(hf))
        out[uaq] = {"logits_diff": float((logits - ref).abs().max()),
                    "weights_exact": sorted(weights) == sorted(want) and all(
                        torch.equal(weights[k], v) for k, v in want.items())}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    # TP 1 then TP 2 in one pair of processes (tests/spawn_in_turn.py)
    return spawn_in_turn([(ws, ws, _worker, ()) for ws in (1, 2)],
                         tmp_path_factory.mktemp("meet"))


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_learner_logits_match_transformers_mixtral(runs, ws: int) -> None:
    plain, uaq = runs[ws][0][1.0], runs[ws][0][1.5]
    assert plain["logits_diff"] <= LOGITS_TOL and uaq["logits_diff"] <= LOGITS_TOL, runs[ws][0]
    assert plain["weights_exact"]  # named_weights: TP-gathered, qurl's per-expert names, bit-exact
    assert not uaq["weights_exact"]  # the masters carry the scaling


# ------------------------------------------------------------------ the derived MoE


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama") / "dense")


def test_derived_moe_with_every_expert_equals_the_dense_llama(llama_dir, tmp_path) -> None:
    from qurl.models.moe_from_dense import DERIVED, derive_moe

    out = derive_moe(llama_dir, tmp_path / "moe", experts=4, top_k=4, method="blocks",
                     router_scale=0.0)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["intermediate_size"], cfg["num_local_experts"]) == (
        ["MixtralForCausalLM"], 32, 4)
    assert json.loads((out / DERIVED).read_text())["experts"] == 4
    assert (out / "tokenizer.json").is_file()
    dense, derived = load_eager(llama_dir), load_eager(out)
    assert type(derived).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = dense(tokens).logits, derived(tokens).logits
    assert (got - want).abs().max().item() <= DENSE_TOL
    # the learner takes it too: the derived checkpoint converts and round-trips
    from qurl.models.hf import read_state_dict

    sd = read_state_dict(out)
    back = moe.to_disk(convert.megatron_to_hf(
        [convert.hf_to_megatron(sd, derived.config, tp_rank=0, tp_size=1)], derived.config),
        derived.config)
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_derived_moe_routes_by_token_and_is_another_model(llama_dir, tmp_path) -> None:
    from qurl.models.moe_from_dense import derive_moe

    a = derive_moe(llama_dir, tmp_path / "a", experts=4, top_k=2, seed=1, method="blocks")
    b = derive_moe(llama_dir, tmp_path / "b", experts=4, top_k=2, seed=1, method="blocks")
    from qurl.models.hf import read_state_dict

    sa, sb = read_state_dict(a), read_state_dict(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # seeded: the same model twice
    dense, derived = load_eager(llama_dir), load_eager(a)
    tokens = torch.arange(0, 96).reshape(1, 96)
    with torch.no_grad():
        out = derived(tokens, output_router_logits=True)
        want = dense(tokens).logits
    top = out.router_logits[0].topk(2, dim=-1).indices.sort(-1).values  # layer 0, [96, 2]
    assert len({tuple(r) for r in top.tolist()}) >= 3  # the router reads the token
    assert (out.logits - want).abs().max().item() > 100 * DENSE_TOL  # top-2 of 4 is not dense


@pytest.mark.parametrize("kw,named", [
    ({"experts": 5}, "divide intermediate_size"),
    ({"top_k": 1}, "top_k=1"),
    ({"top_k": 9}, "top_k=9"),
    ({"method": "random"}, "method='random'"),
    ({"router_scale": -1.0}, "router_scale=-1.0"),
])
def test_derive_refuses_in_one_line(llama_dir, tmp_path, kw, named) -> None:
    from qurl.models.moe_from_dense import derive_moe

    with pytest.raises(ValueError, match=named) as err:
        derive_moe(llama_dir, tmp_path / "x", **kw)
    assert "\n" not in str(err.value)


def test_derive_refuses_a_source_that_is_not_llama(tmp_path) -> None:
    from qurl.models.hf import build_model
    from qurl.models.moe_from_dense import derive_moe

    src = build_model(tmp_path / "q", "tiny")
    with pytest.raises(ValueError, match="LlamaForCausalLM only"):
        derive_moe(src, tmp_path / "x")


def test_real_smollm2_mlp_split_equals_the_dense_mlp() -> None:
    """One real SmolLM2-135M MLP (layers 0 and 29), read straight from the fetched checkpoint:
    transformers' MixtralSparseMoeBlock over its 8 experts, all active, zero router, equals the
    dense SwiGLU on inputs of the size its post-attention norm feeds it (DENSE_TOL relative to
    the largest output)."""
    from safetensors import safe_open
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from qurl.models import registry
    from qurl.models.moe_from_dense import split_mlp

    path = registry.model_path("smollm2-135m")
    if not registry.is_fetched(path):
        pytest.skip(f"smollm2-135m not fetched (run `qurl fetch smollm2-135m`; goes to {path})")
    cfg = MixtralConfig(hidden_size=576, intermediate_size=192, num_local_experts=8,
                        num_experts_per_tok=8)
    cfg._experts_implementation = "eager"
    gen = torch.Generator().manual_seed(0)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for layer in (0, 29):
            p = f"model.layers.{layer}."
            gate, up, down = (f.get_tensor(f"{p}mlp.{w}_proj.weight").float() for w in ("gate", "up", "down"))
            gain = f.get_tensor(p + "post_attention_layernorm.weight").float()
            x = torch.randn(64, 576, generator=gen) * gain  # unit-RMS rows times the norm's gain
            want = torch.nn.functional.linear(
                torch.nn.functional.silu(x @ gate.t()) * (x @ up.t()), down)
            block = MixtralSparseMoeBlock(cfg).eval()
            parts = split_mlp(gate, up, down, 8)
            with torch.no_grad():
                block.gate.weight.zero_()
                block.experts.gate_up_proj.copy_(torch.stack([torch.cat([g, u]) for g, u, _ in parts]))
                block.experts.down_proj.copy_(torch.stack([d for _, _, d in parts]))
                got = block(x[None])[0]
            assert (got - want).abs().max().item() <= DENSE_TOL * want.abs().max().item()


def test_fetch_derives_the_registered_moe_from_its_fetched_source(llama_dir, tmp_path, monkeypatch):
    """`qurl fetch smollm2-135m-moe` (registry.fetch_model) on a models dir whose smollm2-135m is a
    tiny Llama with a valid fetch manifest: derived once, manifest written, found by
    `model.base=smollm2-135m-moe`, and not rebuilt by a second fetch."""
    import shutil

    from qurl.models import registry

    monkeypatch.setenv("QURL_MODELS", str(tmp_path))
    src = tmp_path / "smollm2-135m"
    shutil.copytree(llama_dir, src)
    files = {p.name: registry._file_digest(p) for p in sorted(src.iterdir()) if p.is_file()}
    (src / registry.MANIFEST).write_text(json.dumps({"name": "smollm2-135m", "files": files}))
    out = registry.fetch_model("smollm2-135m-moe")
    assert out == tmp_path / "smollm2-135m-moe" and registry.is_fetched(out)
    cfg = json.loads((out / "config.json").read_text())
    spec = registry.MODELS["smollm2-135m-moe"]
    assert (cfg["model_type"], cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (
        "mixtral", spec.experts, spec.top_k)
    assert json.loads((out / registry.MANIFEST).read_text())["method"] == "cluster"
    assert registry.resolve_base("smollm2-135m-moe") == str(out)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert registry.fetch_model("smollm2-135m-moe") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
