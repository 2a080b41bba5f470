"""Issue 67 item 2 (engine half of 4): Qwen3-MoE in the local engine at bf16 (fp32 here), int8 and
fp8, with the routes it picks.

- full precision: the engine's teacher-forced logits equal transformers' forward (LOGITS_TOL);
- int8 / fp8 (experts fused and 8-bit, router kept): next-token distributions close to full
  precision (KL_BOUND);
- `routed_experts` [P + T - 1, L, k] uint8 equals transformers' router top-k (softmax in fp32 over
  all experts, top-k) on the same tokens, at full precision;
- a weight update landing mid-generation: later positions are routed by the new router. The update
  permutes the experts (router rows and fused experts alike: the same function), so the tokens stay
  and every route after the update is the permuted route.

Tiny model: hidden 64, 2 layers, 8 experts of width 32, top-2 renormalised, the character
tokenizer; weights drawn wide (as tests/tiny_hf.py) so logits and router scores are far from flat.
"""
from __future__ import annotations

import pytest
import torch

from qurl.engines.local import LocalEngine
from qurl.models import moe
from qurl.models.hf import build_model, load_checkpoint
from qurl.quant.named import engine_chunks
from qurl.types import GenRequest, SamplingParams

LOGITS_TOL = 1e-4  # fp32 engine vs transformers' forward: same ops; measured ~1e-6
# KL(full || 8-bit) per token, mean over sampled tokens; measured int8 6e-4, fp8 3e-2 (KL of the
# full model to uniform: 0.83). FP8 E4M3's 3-bit mantissa errs ~4x int8 per expert output (5% vs
# 1.6% of the largest output on this model), and a flipped router top-k replaces a whole expert.
KL_BOUND = {"int8": 5e-3, "fp8": 0.1}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [5, 6, 7, 8, 9]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = build_model(tmp_path_factory.mktemp("moe") / "m", "tiny-qwen3-moe", overrides=TINY)
    model, _ = load_checkpoint(d, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.5 + torch.rand(p.shape, generator=gen) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_checkpoint(model_dir, dtype=torch.float32)[0].eval()


@pytest.fixture(scope="module")
def engines(model_dir):
    cache: dict[str, LocalEngine] = {}

    def get(precision: str) -> LocalEngine:
        if precision not in cache:
            cache[precision] = LocalEngine(model_dir, precision=precision, seed=0)
        return cache[precision]
    return get


def _reqs(max_new: int = 8) -> list[GenRequest]:
    return [GenRequest(rid=str(i), prompt_ids=p,
                       params=SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=i))
            for i, p in enumerate(PROMPTS)]


def _hf_routes(hf, ids: list[int]) -> torch.Tensor:
    """transformers' router top-k at every position of `ids`: [S, L, k] (sorted per position)."""
    k = hf.config.num_experts_per_tok
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), output_router_logits=True, use_cache=False)
    per_layer = [torch.softmax(r.float(), dim=-1).topk(k, dim=-1).indices for r in out.router_logits]
    return torch.stack(per_layer, dim=1).sort(dim=-1).values


def test_full_precision_logits_equal_transformers(engines, hf):
    eng = engines("bf16")
    for r in eng.generate(_reqs()):
        ids = r.prompt_ids + r.output_ids.tolist()
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        got = eng.token_logits(r.prompt_ids, r.output_ids.tolist())
        p = len(r.prompt_ids)
        want = ref[p - 1 : p - 1 + len(r.output_ids)]
        assert (got - want).abs().max().item() < LOGITS_TOL


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_experts_close_to_full_precision(engines, fmt):
    full, q = engines("bf16"), engines(fmt)
    held = q.names()
    assert "model.layers.1.mlp.experts.w13_weight_scale" in held and "model.layers.1.mlp.gate.weight" in held
    assert q._tensors["model.layers.1.mlp.experts.w13_weight"].dtype == {
        "int8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt]
    assert q._tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # router: full
    assert tuple(q._tensors["model.layers.0.mlp.experts.w2_weight_scale"].shape) == (8, 64, 1)
    kls = []
    for r in full.generate(_reqs()):
        a = full.token_logits(r.prompt_ids, r.output_ids.tolist()).double().log_softmax(-1)
        b = q.token_logits(r.prompt_ids, r.output_ids.tolist()).double().log_softmax(-1)
        kls.append((a.exp() * (a - b)).sum(-1))
    assert 0 < torch.cat(kls).mean().item() < KL_BOUND[fmt]  # > 0: the experts really are 8-bit


def test_routes_equal_transformers_router_topk(engines, hf):
    eng = engines("bf16")
    results = eng.generate(_reqs())
    L, k = hf.config.num_hidden_layers, hf.config.num_experts_per_tok
    for r in results:
        T, P = len(r.output_ids), len(r.prompt_ids)
        got = r.routed_experts
        assert got.dtype == torch.uint8 and tuple(got.shape) == (P + T - 1, L, k)
        ids = r.prompt_ids + r.output_ids.tolist()[:-1]  # every position the engine forwarded
        assert torch.equal(got.long().sort(dim=-1).values, _hf_routes(hf, ids))
    assert torch.equal(results[0].routed_experts[:5], results[2].routed_experts[:5])  # one prefill


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_engines_return_routes_of_their_own(engines, fmt):
    for r in engines(fmt).generate(_reqs(4)):
        assert tuple(r.routed_experts.shape) == (len(r.prompt_ids) + len(r.output_ids) - 1, 2, 2)
        assert int(r.routed_experts.max()) < 8


def _permuted(hf, perm: list[int]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's per-expert weights with new expert j = old expert perm[j] (the same
    function): router rows and experts permuted alike."""
    sd = moe.per_expert({k: v.detach().clone() for k, v in hf.state_dict().items()})
    out = dict(sd)
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        out[p + "gate.weight"] = sd[p + "gate.weight"][perm]
        for j, e in enumerate(perm):
            for w in ("gate", "up", "down"):
                out[f"{p}experts.{j}.{w}_proj.weight"] = sd[f"{p}experts.{e}.{w}_proj.weight"]
    out.pop("lm_head.weight", None)  # tied: the engine takes the embedding's name
    return list(out.items())


def test_routes_across_a_weight_update_mid_generation(model_dir, hf):
    perm = [3, 0, 7, 1, 6, 2, 5, 4]
    inv = torch.tensor([perm.index(e) for e in range(8)], dtype=torch.uint8)
    plain = LocalEngine(model_dir, precision="int8", seed=0).generate(_reqs())
    eng = LocalEngine(model_dir, precision="int8", seed=0)
    chunks = list(engine_chunks(_permuted(hf, perm), "int8", wire_dtype=torch.float32))
    steps = []

    def between() -> None:
        steps.append(1)
        if len(steps) == 3:
            eng.load_weights(iter(chunks), 1)
    moved = eng.generate(_reqs(), between_steps=between)
    for a, b in zip(plain, moved):
        assert torch.equal(a.output_ids, b.output_ids)  # the same function, the same tokens
        P = len(a.prompt_ids)
        assert b.versions.tolist() == [0] * 3 + [1] * (len(b.versions) - 3)
        # positions forwarded before the update (prompt + 2 decode steps) keep their routes ...
        assert torch.equal(a.routed_experts[: P + 2], b.routed_experts[: P + 2])
        # ... and later ones are the permuted router's choice of the same experts
        assert torch.equal(inv[a.routed_experts[P + 2 :].long()].sort(-1).values,
                           b.routed_experts[P + 2 :].sort(-1).values)


def test_refusals_are_one_line(model_dir):
    with pytest.raises(ValueError, match="no MoE experts"):
        LocalEngine(model_dir, precision="w4a16")
