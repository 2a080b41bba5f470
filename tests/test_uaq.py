"""UAQ invariant scaling and flip fractions, on a real transformers Qwen2ForCausalLM (random weights).

The flip experiment: from the same initial weights, data and seed, take one AdamW step (lr 1e-6) on
the model scaled with s=1.5 and on the unscaled one (s=1), re-quantize to INT8, and count codes that
changed. Adam's first step moves every weight by ≈ lr whatever its gradient's scale, while UAQ
shrinks the INT8 grid of q/k/v/gate/up by s, so those layers must flip ≈ 1.5× more codes; o_proj and
down_proj see the same function and gradients, so theirs must not change. The model (0.8M scaled
weights) is sized so the s=1 run flips ~1600 codes in the scaled layers: the ratio's sampling noise
(≈ sqrt(0.5/n)) is then ~2%, well inside the 1.5 vs 1.4 margin (measured: 1.51).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from qurl.quant.flips import flip_fraction, flip_fractions
from qurl.quant.named import is_quantized_linear, quantize_named
from qurl.quant.uaq import DEFAULT_S, apply_uaq, uaq_pairs, uaq_scaled


def _config(hidden: int = 64, inter: int = 128, layers: int = 2) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def _model(cfg: Qwen2Config, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # non-trivial norm gains and biases, so their handling is really tested
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
    return model


def _tokens(cfg: Qwen2Config, seed: int, shape: tuple[int, int] = (2, 16)) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_uaq_preserves_the_function_of_a_real_qwen2() -> None:
    cfg = _config()
    model = _model(cfg, seed=0)
    ids = _tokens(cfg, 1)
    with torch.no_grad():
        ref = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    snapshot = {k: v.clone() for k, v in state.items()}
    scaled = apply_uaq(state, DEFAULT_S)
    for k in state:  # the input is untouched
        assert torch.equal(state[k], snapshot[k]), k
    model.load_state_dict(scaled)
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # and the weights really changed: exactly the norm/linear pairs, by the factor s
    l0 = "model.layers.0."
    for suffix, factor in (
        ("self_attn.q_proj.weight", 1 / DEFAULT_S), ("self_attn.v_proj.weight", 1 / DEFAULT_S),
        ("mlp.up_proj.weight", 1 / DEFAULT_S), ("input_layernorm.weight", DEFAULT_S),
        ("post_attention_layernorm.weight", DEFAULT_S), ("self_attn.q_proj.bias", 1.0),
        ("self_attn.o_proj.weight", 1.0), ("mlp.down_proj.weight", 1.0),
    ):  # fmt: skip
        torch.testing.assert_close(scaled[l0 + suffix], state[l0 + suffix] * factor)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert scaled[name] is state[name]


def test_uaq_names_and_errors() -> None:
    names = list(_model(_config(layers=1), seed=0).state_dict())
    assert uaq_pairs(names) == [
        ("model.layers.0.input_layernorm.weight",
         [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]),
        ("model.layers.0.post_attention_layernorm.weight",
         ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]),
    ]  # fmt: skip
    scaled = [n for n in names if uaq_scaled(n)]
    assert len(scaled) == 5 and all(is_quantized_linear(n) for n in scaled)
    assert not uaq_scaled("model.layers.0.self_attn.o_proj.weight")
    assert not uaq_scaled("model.layers.0.self_attn.q_proj.bias")
    w = {"model.layers.0.input_layernorm.weight": torch.ones(4)}
    w.update({f"model.layers.0.self_attn.{p}_proj.weight": torch.ones(4, 4) for p in "qkv"})
    for bad in (0.0, -1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="s must be"):
            apply_uaq(w, bad)
    partial = {k: v for k, v in w.items() if "k_proj" not in k}
    with pytest.raises(ValueError, match="only"):
        apply_uaq(partial)
    orphan = {k: v for k, v in w.items() if "layernorm" not in k}
    with pytest.raises(ValueError, match="no feeding norm"):
        apply_uaq(orphan)
    assert apply_uaq(w, 1.0)["model.layers.0.self_attn.q_proj.weight"].equal(torch.ones(4, 4))


def test_uaq_preserves_the_function_of_a_real_qwen3_and_leaves_its_qk_norms() -> None:
    """Qwen3 normalises each head of q_proj's and k_proj's outputs; UAQ scales their input and
    weights inversely, so the outputs, their norms and the logits are unchanged (fp32 rounding)."""
    from tiny_hf import build, hf_state

    model = build("qwen3")
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    state = hf_state(model)
    scaled = apply_uaq(state, DEFAULT_S)
    for name in ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"):
        assert scaled[name] is state[name]  # not touched
    torch.testing.assert_close(scaled["model.layers.0.self_attn.k_proj.weight"],
                               state["model.layers.0.self_attn.k_proj.weight"] / DEFAULT_S)
    model.load_state_dict(scaled, strict=False)  # a tied lm_head is not in the state
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_flip_fraction_basics() -> None:
    a = torch.tensor([[1, 2, 3, 4]], dtype=torch.int8)
    b = torch.tensor([[1, 2, -3, 4]], dtype=torch.int8)
    assert flip_fraction(a, b) == 0.25 and flip_fraction(a, a) == 0.0
    f = torch.tensor([0.0, 1.0, 2.0, 448.0]).to(torch.float8_e4m3fn)
    g = torch.tensor([-0.0, 1.0, 2.5, 448.0]).to(torch.float8_e4m3fn)
    assert flip_fraction(f, g) == 0.5  # bitwise: -0 is a different code from +0
    with pytest.raises(ValueError, match="shape"):
        flip_fraction(a, b.view(2, 2))
    with pytest.raises(ValueError, match="dtype"):
        flip_fraction(a, b.to(torch.int16))
    with pytest.raises(ValueError, match="empty"):
        flip_fraction(a[:, :0], b[:, :0])
    with pytest.raises(ValueError, match="different quantized linears"):
        flip_fractions({"model.layers.0.mlp.up_proj.weight": a}, {})


def _flips_after_one_adamw_step(
    cfg: Qwen2Config, s: float
) -> tuple[dict[str, float], dict[str, torch.Tensor], int]:
    """(flip fractions, INT8 chunks before the step, number of UAQ-scaled weights)."""
    model = _model(cfg, seed=0)
    model.load_state_dict(apply_uaq(model.state_dict(), s))
    model.train()
    before = {k: v.clone() for k, v in quantize_named(model.state_dict().items(), "int8")}
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = _tokens(cfg, 2, (4, 32))
    model(ids, labels=ids).loss.backward()
    opt.step()
    after = dict(quantize_named(model.state_dict().items(), "int8"))
    n_scaled = sum(v.numel() for k, v in before.items() if uaq_scaled(k))
    return flip_fractions(before, after), before, n_scaled


def test_uaq_flips_more_codes_in_scaled_layers() -> None:
    cfg = _config(hidden=256, inter=512, layers=2)
    base, codes_base, n_scaled = _flips_after_one_adamw_step(cfg, 1.0)
    uaq, codes_uaq, _ = _flips_after_one_adamw_step(cfg, 1.5)
    # UAQ does not move the INT8 codes themselves, only the grid: step-0 codes agree
    for name, codes in codes_base.items():
        if uaq_scaled(name):
            assert flip_fraction(codes, codes_uaq[name]) < 1e-3, name
    assert base["uaq_scaled"] * n_scaled > 1000  # enough flips for the ratio to be meaningful
    ratio = uaq["uaq_scaled"] / base["uaq_scaled"]
    assert ratio >= 1.4, ratio
    assert ratio <= 1.7, ratio  # ≈ s: a much larger ratio would mean something else changed
    for kind in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert uaq[kind] / base[kind] >= 1.3, (kind, uaq[kind], base[kind])
    # unscaled layers: same function, same gradients, same flips
    assert base["unscaled"] > 0
    assert uaq["unscaled"] == pytest.approx(base["unscaled"], rel=0.03)


def test_code_shift_of_uaq_on_a_real_qwen2(tmp_path, capsys) -> None:
    """qurl.research.studies.uaq_codes: s = 2 divides exactly, so not one code may move; s = 1.5 rounds, and
    only weights within fp32 rounding of a code boundary may move; o/down are never touched."""
    import json

    from qurl.research.studies.uaq_codes import code_shift, main

    model = _model(_config(hidden=128, inter=256), seed=3)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    exact = code_shift(state, 2.0)
    assert exact["all"] == 0.0 and exact["uaq_scaled"] == 0.0
    for fmt in ("int8", "fp8"):
        rounded = code_shift(state, 1.5, fmt)
        assert rounded["unscaled"] == 0.0
        assert rounded["uaq_scaled"] < 1e-3, (fmt, rounded)
    model.save_pretrained(tmp_path)  # the CLI reads a checkpoint directory: same numbers
    assert main([str(tmp_path), "--scales", "2", "1.5"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["s"] for r in lines] == [2.0, 1.5]
    assert lines[0]["all"] == 0.0
    assert lines[1]["uaq_scaled"] == pytest.approx(code_shift(state, 1.5)["uaq_scaled"])


def test_ulp_nudges_move_only_the_norm_gains_by_exactly_one_ulp():
    """qurl.research.studies.ulp_sensitivity's nudge arm: each norm gain element one representable fp32
    value away (up or down, both happen), every other tensor the very same object."""
    from qurl.research.studies.ulp_sensitivity import nudged

    g = torch.Generator().manual_seed(0)
    masters = {"model.layers.0.input_layernorm.weight": torch.rand(64, generator=g) + 0.5,
               "model.layers.0.self_attn.q_norm.weight": torch.rand(16, generator=g),
               "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g),
               "model.norm.weight": torch.rand(64, generator=g) + 0.5}
    out = nudged(masters, seed=3)
    assert out["model.layers.0.self_attn.q_proj.weight"] is masters["model.layers.0.self_attn.q_proj.weight"]
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
                 "model.norm.weight"):
        a, b = masters[name], out[name]
        steps = b.view(torch.int32).long() - a.view(torch.int32).long()  # positive floats: ulps
        assert set(steps.tolist()) == {-1, 1}, name
    assert not torch.equal(nudged(masters, seed=4)["model.norm.weight"], out["model.norm.weight"])
