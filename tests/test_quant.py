"""Quantizers (qurl.quant.formats) and the named-weight stream (qurl.quant.named).

Bounds asserted: INT8 round trip |w - deq| <= scale/2 per element; FP8 E4M3 relative error <= 2^-4
for values in the normal range (|w/scale| >= 2^-6), absolute <= 2^-10 * scale below it. A relative
slack of 1e-5 covers the fp32 division/multiplication around the rounding.
"""

from __future__ import annotations

import pytest
import torch

from qurl.quant.formats import (
    FP8_MAX,
    INT8_MAX,
    dequantize_fp8_block,
    dequantize_per_channel,
    dequantize_per_token,
    quantize_fp8_block,
    quantize_per_channel,
    quantize_per_token,
)
from qurl.quant.named import dequantize_named, is_quantized_linear, quantize_named

SLACK = 1e-5


def _weights(out: int = 64, inn: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inn, generator=g) * 0.02
    w[3, 5] = 1.7  # an outlier row
    w[7] = 0.0  # an all-zero row
    return w


def _check_int8(w: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> None:
    err = (deq - w.float()).abs()
    assert bool((err <= scale * (0.5 + SLACK)).all()), float((err / scale).max())


def _check_fp8(w: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> None:
    w = w.float()
    err = (deq - w).abs()
    normal = (w / scale).abs() >= 2.0**-6
    assert bool((err[normal] <= w.abs()[normal] * (2.0**-4 + SLACK)).all())
    sub = ~normal
    bound = (scale.expand_as(w) * (2.0**-10 + SLACK))[sub]
    assert bool((err[sub] <= bound).all())


def test_int8_per_channel_round_trip_bound() -> None:
    w = _weights()
    codes, scale = quantize_per_channel(w, "int8")
    assert codes.dtype == torch.int8 and codes.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1)
    assert int(codes.abs().max()) == INT8_MAX and int(codes.min()) >= -INT8_MAX
    # every nonzero row uses its full range: its absmax maps to +-127
    nz = w.abs().amax(1) > 0
    assert bool((codes.abs().amax(1)[nz] == INT8_MAX).all())
    torch.testing.assert_close(scale[nz, 0], w.abs().amax(1)[nz] / INT8_MAX)
    _check_int8(w, dequantize_per_channel(codes, scale), scale)


def test_fp8_per_channel_round_trip_bound() -> None:
    w = _weights(seed=1)
    codes, scale = quantize_per_channel(w, "fp8")
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0], 1)
    assert float(codes.float().abs().max()) == FP8_MAX
    deq = dequantize_per_channel(codes, scale)
    _check_fp8(w, deq, scale)
    # the 2^-4 bound is tight-ish: random values do use a good part of it
    normal = (w / scale).abs() >= 2.0**-6
    assert float(((deq - w).abs() / w.abs())[normal].max()) > 2.0**-5


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_zero_rows_and_huge_outliers(fmt: str) -> None:
    w = torch.zeros(4, 8)
    w[1, 2] = 3.0e38  # near fp32 max: absmax / qmax must not overflow, nothing may turn NaN
    w[1, 3] = 1.0
    w[2] = torch.tensor([1e-30, -2e-30, 0, 0, 0, 0, 0, 5e-31])  # tiny but nonzero
    w[3, 0] = -1e30
    codes, scale = quantize_per_channel(w, fmt)
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    assert float(scale[0, 0]) == 1.0  # all-zero row: safe scale, zero codes, exact zero back
    deq = dequantize_per_channel(codes, scale)
    assert not bool(torch.isnan(codes.float()).any()) and not bool(torch.isnan(deq).any())
    assert bool((deq[0] == 0).all())
    q = INT8_MAX if fmt == "int8" else FP8_MAX
    assert float(codes[1, 2].float()) == q and float(codes[3, 0].float()) == -q
    assert float(codes[1, 3].float()) == 0.0  # swamped by the outlier: rounds to zero, no NaN
    assert float(deq[3, 0]) == pytest.approx(-1e30, rel=1e-6)
    if fmt == "int8":
        _check_int8(w, deq, scale)
    else:
        _check_fp8(w, deq, scale)


def test_bf16_input_is_upcast() -> None:
    w = _weights(seed=2).to(torch.bfloat16)
    codes, scale = quantize_per_channel(w, "int8")
    _check_int8(w, dequantize_per_channel(codes, scale), scale)
    assert dequantize_per_channel(codes, scale, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_per_token_activations(fmt: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 32, generator=g) * 4
    x[1, 2] = 0.0
    codes, scale = quantize_per_token(x, fmt)
    assert codes.shape == x.shape and scale.shape == (2, 5, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale[0, 0, 0], x[0, 0].abs().max() / (INT8_MAX if fmt == "int8" else FP8_MAX))
    deq = dequantize_per_token(codes, scale)
    assert bool((deq[1, 2] == 0).all())
    if fmt == "int8":
        _check_int8(x, deq, scale)
    else:
        _check_fp8(x, deq, scale)


def test_fp8_block_scaling() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 300, generator=g) * 0.05
    w[130, 260] = 40.0  # outlier confined to tile (1, 2)
    w[:128, 128:256] = 0.0  # an all-zero tile
    codes, scale = quantize_fp8_block(w, block=128)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
    assert scale.shape == (2, 3) and scale.dtype == torch.float32
    # scale = tile absmax / 448, computed here independently per tile
    for bi in range(2):
        for bj in range(3):
            tile = w[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
            expect = tile.abs().max() / FP8_MAX if tile.abs().max() > 0 else torch.tensor(1.0)
            torch.testing.assert_close(scale[bi, bj], expect)
    deq = dequantize_fp8_block(codes, scale, block=128)
    assert bool((deq[:128, 128:256] == 0).all())
    full_scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    _check_fp8(w, deq, full_scale)
    # the outlier coarsens only its own tile: a neighbouring tile keeps fine precision
    assert float((deq[:128, :128] - w[:128, :128]).abs().max()) < 0.05 * 2.0**-4 * 4


def test_quantizer_errors() -> None:
    with pytest.raises(ValueError, match="fmt"):
        quantize_per_channel(torch.ones(2, 2), "int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2-D"):
        quantize_per_channel(torch.ones(2, 2, 2), "int8")
    with pytest.raises(ValueError, match="NaN"):
        quantize_per_channel(torch.tensor([[1.0, float("nan")]]), "int8")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_per_token(torch.tensor([[1.0, float("inf")]]), "fp8")
    with pytest.raises(ValueError, match="block"):
        quantize_fp8_block(torch.ones(4, 4), block=0)
    with pytest.raises(ValueError, match="scale"):
        dequantize_fp8_block(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(2, 2), block=128)
    with pytest.raises(ValueError, match="scale"):
        dequantize_per_channel(torch.zeros(4, 4, dtype=torch.int8), torch.ones(4))


# ---- named weights ---------------------------------------------------------------------------


def test_is_quantized_linear() -> None:
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.12.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ):
        assert is_quantized_linear(name), name
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.q_proj.weight_scale",
        "model.layers.x.self_attn.q_proj.weight",
    ):
        assert not is_quantized_linear(name), name


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "model.embed_tokens.weight": torch.randn(10, 8, generator=g),
        "model.layers.0.input_layernorm.weight": torch.ones(8),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(8, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(10, 8, generator=g),
    }


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantize_named_layout_and_inverse(fmt: str) -> None:
    state = _state()
    chunks = list(quantize_named(state.items(), fmt))
    names = [n for n, _ in chunks]
    assert names == [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight_scale",
        "lm_head.weight",
    ]
    got = dict(chunks)
    code_dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == code_dtype
    assert got["model.layers.0.mlp.down_proj.weight_scale"].shape == (8, 1)
    for n in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias", "lm_head.weight"):
        assert got[n] is state[n]  # passthrough is untouched, not copied
    back = dequantize_named(got)
    assert set(back) == set(state)
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        c, s = quantize_per_channel(state[n], fmt)  # type: ignore[arg-type]
        torch.testing.assert_close(back[n], dequantize_per_channel(c, s), rtol=0, atol=0)


def test_quantize_named_fp8_block_layout_and_inverse() -> None:
    """SGLang's block FP8: codes + `_scale_inv` with one scale per 128x128 tile (a 200x300 linear
    has a 2x3 grid), dequantized with the same tiles."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(200, 300, generator=g)
    state = {"model.layers.3.mlp.up_proj.weight": w, "model.norm.weight": torch.ones(300)}
    got = dict(quantize_named(state, "fp8_block"))
    assert list(got) == ["model.layers.3.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight_scale_inv",
                         "model.norm.weight"]
    assert got["model.layers.3.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert got["model.layers.3.mlp.up_proj.weight_scale_inv"].shape == (2, 3)
    codes, scale = quantize_fp8_block(w, 128)
    assert torch.equal(got["model.layers.3.mlp.up_proj.weight_scale_inv"], scale)
    back = dequantize_named(got)
    torch.testing.assert_close(back["model.layers.3.mlp.up_proj.weight"], dequantize_fp8_block(codes, scale),
                               rtol=0, atol=0)
    assert float(((back["model.layers.3.mlp.up_proj.weight"] - w).abs() / w.abs().clamp_min(1e-3)).median()) < 2**-4


def test_quantize_named_bf16_passthrough_and_errors() -> None:
    state = _state()
    out = list(quantize_named(state, "bf16"))
    assert [n for n, _ in out] == list(state) and all(t is state[n] for n, t in out)
    with pytest.raises(ValueError, match="fmt"):
        list(quantize_named(state, "int4"))
    with pytest.raises(ValueError, match="q_proj.weight"):
        list(quantize_named([("model.layers.0.self_attn.q_proj.weight", torch.ones(8))], "int8"))
    q = dict(quantize_named(state, "int8"))
    del q["model.layers.0.self_attn.q_proj.weight_scale"]
    with pytest.raises(ValueError, match="without"):
        dequantize_named(q)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantize_into_out_buffers_is_bit_identical(fmt):
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(3)) * 0.05
    w[5] = 0.0  # an all-zero row: scale 1, codes 0
    codes, scale = quantize_per_channel(w, fmt)
    out = (torch.full_like(codes, 7) if fmt == "int8" else torch.zeros_like(codes),
           torch.full((24, 1), -1.0))
    got = quantize_per_channel(w, fmt, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(out[1], scale)
    with pytest.raises(ValueError, match="out must be"):
        quantize_per_channel(w, fmt, out=(torch.zeros(24, 40, dtype=torch.int16), out[1]))
    with pytest.raises(ValueError, match="out scale"):
        quantize_per_channel(w, fmt, out=(out[0], torch.zeros(24)))


def test_non_finite_anywhere_in_a_row_is_refused():
    # finiteness is checked on the row maxima: NaN and inf must reach them from any position
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = torch.randn(64, 300)
        w[17, 211] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            quantize_per_channel(w, "int8")
        with pytest.raises(ValueError, match="NaN or inf"):
            quantize_fp8_block(w, 128)
        with pytest.raises(ValueError, match="NaN or inf"):
            quantize_per_token(w.bfloat16(), "int8")


def test_all_finite_against_isfinite():
    from qurl.quant.formats import all_finite

    g = torch.Generator().manual_seed(0)
    base = torch.randn(3 << 20, generator=g)  # three sum chunks
    cases = [base, base.bfloat16(), torch.full((9,), 3.0e38), torch.empty(0)]  # 3e38 x 9 overflows the sum
    for pos, bad in ((5, float("nan")), ((3 << 20) - 1, float("inf")), (2 << 20, float("-inf"))):
        x = base.clone()
        x[pos] = bad
        cases += [x, x.bfloat16()]
    huge = torch.full((9,), 3.0e38)
    huge[7] = float("inf")
    cases += [huge, huge.bfloat16(), torch.full((9,), 3.0e38).bfloat16()]  # bf16 sums in bf16
    half = torch.full((5000,), 6.0e4).half()  # an fp16 sum would overflow: summed in fp32
    half_nan = half.clone()
    half_nan[4999] = float("nan")
    cases += [half, half_nan]
    for x in cases:
        assert all_finite(x) == bool(torch.isfinite(x).all()), (x.dtype, x.numel())


def test_fp8_has_nan_on_every_code_pattern():
    """All 256 E4M3FN bit patterns, one at a time and mixed into finite codes: fp8_has_nan agrees
    with widening to fp32 (only 0x7F and 0xFF are NaN; the format has no inf)."""
    from qurl.quant.formats import fp8_has_nan

    patterns = torch.arange(256, dtype=torch.uint8)
    finite = torch.full((1000,), 0x38, dtype=torch.uint8)  # 1.0
    for p in patterns:
        one = p.reshape(1).view(torch.float8_e4m3fn)
        want = bool(torch.isnan(one.float()).any())
        assert fp8_has_nan(one) == want, int(p)
        mixed = finite.clone()
        mixed[517] = p
        assert fp8_has_nan(mixed.view(torch.float8_e4m3fn)) == want, int(p)
    assert sum(fp8_has_nan(p.reshape(1).view(torch.float8_e4m3fn)) for p in patterns) == 2
    assert not fp8_has_nan(torch.empty(0, dtype=torch.float8_e4m3fn))
