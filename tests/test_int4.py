"""INT4 weight-only group-wise rollout (the ablation's stress format): the quantizer against a
float64 reference and hand-worked codes, the W4A16 linear, the named/wire layout, and the local
engine in int4 against a float model holding the same dequantized weights."""
from __future__ import annotations

import pytest
import torch

from qurl.config import ConfigError, load_config
from qurl.engines.local import LocalEngine
from qurl.engines.qlinear import Int4Linear
from qurl.models.hf import build_model, load_checkpoint, read_state_dict
from qurl.quant.int4 import (INT4_GROUP, check_int4_codes, dequantize_int4_groups,
                             quantize_int4_groups)
from qurl.quant.named import dequantize_named, quantize_named
from qurl.weights.publish import WeightSync


def _reference(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: scale = group absmax / 7 (1 for an all-zero group), codes = round-half-even."""
    w64 = w.double().reshape(w.shape[0], -1, group)
    scale = w64.abs().amax(dim=2) / 7
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w64 / scale.unsqueeze(2)).clamp(-7, 7).reshape(w.shape)
    return codes, scale


def test_quantizer_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4 * INT4_GROUP, generator=g) * torch.logspace(-3, 1, 6).unsqueeze(1)
    w[2, :INT4_GROUP] = 0.0  # an all-zero group
    codes, scale = quantize_int4_groups(w)
    ref_codes, ref_scale = _reference(w, INT4_GROUP)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.shape == (6, 4)
    torch.testing.assert_close(scale.double(), ref_scale, rtol=1e-6, atol=0)
    assert scale[2, 0] == 1.0 and (codes[2, :INT4_GROUP] == 0).all()
    # fp32 vs float64 division can only differ for a value within ~1e-6 of a half: none here
    assert torch.equal(codes.double(), ref_codes)
    err = (dequantize_int4_groups(codes, scale).double() - w.double()).abs()
    bound = scale.double().repeat_interleave(INT4_GROUP, dim=1) / 2
    assert bool((err <= bound * (1 + 1e-6)).all())


def test_hand_worked_codes_round_half_to_even():
    # group of 4: absmax 7 -> scale exactly 1; 3.5 -> 4, 1.5 -> 2, 0.5 -> 0 (ties to even)
    w = torch.tensor([[3.5, -7.0, 1.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    codes, scale = quantize_int4_groups(w, group=4)
    assert codes.tolist() == [[4, -7, 2, 0, 0, 0, 0, 0]]
    assert scale.tolist() == [[1.0, 1.0]]  # the second group is all zero
    # bf16 input: the same codes (arithmetic is fp32)
    assert torch.equal(quantize_int4_groups(w.bfloat16(), group=4)[0], codes)


def test_bad_input_and_bad_codes_are_refused():
    with pytest.raises(ValueError, match="do not tile"):
        quantize_int4_groups(torch.ones(2, INT4_GROUP + 1))
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_int4_groups(torch.tensor([[1.0, float("nan")]]), group=2)
    codes, scale = quantize_int4_groups(torch.randn(3, 2 * INT4_GROUP))
    check_int4_codes(codes, scale, (3, 2 * INT4_GROUP))
    bad = codes.clone()
    bad[0, 0] = -8
    with pytest.raises(ValueError, match=r"outside \[-7, 7\]"):
        check_int4_codes(bad, scale, (3, 2 * INT4_GROUP), name="q")
    with pytest.raises(ValueError, match="q_scale: expected float group scales"):
        check_int4_codes(codes, scale[:, :1], (3, 2 * INT4_GROUP), name="q")


def test_int4_linear_is_a_float_linear_of_the_dequantized_weight():
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(2 * INT4_GROUP, 5, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
    q = Int4Linear.from_linear(lin)
    x = torch.randn(3, 4, 2 * INT4_GROUP, generator=g)
    w64 = dequantize_int4_groups(q.weight, q.weight_scale, torch.float64)
    ref = x.double() @ w64.t() + lin.bias.double()
    torch.testing.assert_close(q(x).double(), ref, rtol=1e-5, atol=1e-5)
    # new codes invalidate the cached dequantized weight
    q.load_codes(torch.zeros_like(q.weight), torch.ones_like(q.weight_scale))
    torch.testing.assert_close(q(x), lin.bias.detach().expand(3, 4, 5))


def test_rows_128_does_not_tile_use_the_largest_dividing_power_of_two():
    """A real model's hidden 576 (SmolLM2-135M) = 9 x 64: groups of 64 there, 128 elsewhere; the
    linear, the named layout and the dequantizer all follow the group the shapes imply."""
    from qurl.quant.int4 import int4_group

    assert [int4_group(n) for n in (576, 1536, 256, 96)] == [64, 128, 128, 32]
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(576, 6, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
    q = Int4Linear.from_linear(lin)
    assert q.weight_scale.shape == (6, 9)
    codes, scale = _reference(lin.weight.detach(), 64)
    assert torch.equal(q.weight.double(), codes) and torch.allclose(q.weight_scale.double(), scale)
    named = dict(quantize_named({"model.layers.0.self_attn.q_proj.weight": lin.weight.detach()},
                                "w4a16"))
    assert named["model.layers.0.self_attn.q_proj.weight_scale"].shape == (6, 9)
    torch.testing.assert_close(dequantize_int4_groups(q.weight, q.weight_scale),
                               codes.float() * scale.float().repeat_interleave(64, 1))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "tiny2", "tiny", seed=1,
                       overrides={"num_hidden_layers": 2, "initializer_range": 0.1})


def test_engine_int4_scores_like_the_dequantized_float_model(model_dir, one_thread):
    """The int4 engine's teacher-forced logprobs equal an fp32 HF model whose linears hold the
    dequantized int4 weights; weights pushed through the weight sync give the same engine."""
    state = read_state_dict(model_dir)
    deq = dequantize_named(dict(quantize_named(state.items(), "w4a16")))
    assert set(deq) == set(state)
    ref_model, tok = load_checkpoint(model_dir, dtype=torch.float32)
    ref_model.load_state_dict(deq, strict=False)
    eng = LocalEngine(model_dir, precision="w4a16", seed=0)
    prompt = tok.encode("12+34=")
    out = tok.encode("46 \\boxed{46}")
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = ref_model(input_ids=ids).logits[0, len(prompt) - 1: -1].double()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(eng.logprobs(prompt, out).double(), ref, rtol=1e-4, atol=1e-4)
    # the same weights, sent by the weight sync as int4 codes + group scales
    fresh = LocalEngine(model_dir, precision="w4a16", seed=0)
    stats = WeightSync("w4a16").push(iter(state.items()), fresh, version=3)
    assert fresh.version == 3 and stats["sync/bytes"] > 0
    torch.testing.assert_close(fresh.logprobs(prompt, out), eng.logprobs(prompt, out))
    # and the int4 engine is measurably further from the float model than int8 is
    full = LocalEngine(model_dir, precision="bf16").logprobs(prompt, out)
    int8 = LocalEngine(model_dir, precision="int8").logprobs(prompt, out)
    assert (eng.logprobs(prompt, out) - full).abs().mean() > (int8 - full).abs().mean()


def test_config_int4_is_local_only():
    assert load_config(sets=["rollout.precision=w4a16"]).rollout.precision == "w4a16"
    with pytest.raises(ConfigError, match="rollout.precision='w4a16'"):
        load_config(sets=["rollout.precision=w4a16", "rollout.engine=sglang"])
