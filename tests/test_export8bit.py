"""8-bit checkpoints for SGLang: names, dtypes, config.json quantization_config, and the round trip
read-back + dequantize == learner weights within each format's rounding error."""
from __future__ import annotations

import json

import pytest
import torch

from qurl.models.export8bit import export_8bit, read_8bit
from qurl.models.hf import build_model, read_state_dict
from qurl.quant.named import is_quantized_linear
from qurl.quant.uaq import apply_uaq


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=0)


@pytest.mark.parametrize("fmt,qcfg,scale_name,scale_shape", [
    ("int8", {"quant_method": "w8a8_int8", "is_dynamic": True, "ignore": []}, "weight_scale",
     lambda o, i: (o, 1)),
    ("fp8", {"quant_method": "w8a8_fp8"}, "weight_scale", lambda o, i: (o, 1)),
    ("fp8_block", {"quant_method": "fp8", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}, "weight_scale_inv",
     lambda o, i: (-(-o // 128), -(-i // 128))),
])
def test_export_round_trip(tmp_path, tiny, fmt, qcfg, scale_name, scale_shape):
    out = export_8bit(tiny, tmp_path / fmt, fmt, uaq_scale=1.5)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == qcfg and config["torch_dtype"] == "bfloat16"
    assert (out / "tokenizer.json").is_file() and not (tmp_path / f"{fmt}.tmp").exists()
    raw = read_state_dict(out)
    learner = apply_uaq(read_state_dict(tiny), 1.5)  # the weights the learner syncs as v0
    code_dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    n_linear = 0
    for name, w in learner.items():
        if is_quantized_linear(name):
            n_linear += 1
            base = name[: -len("weight")]
            assert raw[name].dtype == code_dtype and raw[name].shape == w.shape
            scale = raw[base + scale_name]
            assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape(*w.shape)
        else:
            assert raw[name].dtype == torch.bfloat16, name  # full precision kept, in bf16
    assert n_linear == 4 * 7
    back, got_cfg = read_8bit(out)
    assert got_cfg == qcfg and back.keys() == learner.keys()
    for name, w in learner.items():
        err = (back[name].float() - w.float()).abs()
        if is_quantized_linear(name):
            if fmt == "int8":  # half a grid step of the row's scale (absmax / 127)
                bound = w.abs().amax(dim=1, keepdim=True) / 127 * 0.5 * 1.0001
            else:  # E4M3: relative 2^-4 in the normal range, absolute 2^-10 * scale below it
                bound = w.abs() * 2 ** -4 + w.abs().max() / 448 * 2 ** -9
            assert bool((err <= bound).all()), name
        else:  # bf16 rounding: relative 2^-8
            assert bool((err <= w.abs() * 2 ** -8 + 1e-30).all()), name


def test_bf16_export_and_bad_inputs(tmp_path, tiny):
    out = export_8bit(tiny, tmp_path / "bf16", "bf16")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    back, qcfg = read_8bit(out)
    assert qcfg is None and all(t.dtype == torch.bfloat16 for t in back.values())
    with pytest.raises(ValueError, match="fmt"):
        export_8bit(tiny, tmp_path / "x", "int4")
    with pytest.raises(ValueError, match="missing config.json"):
        export_8bit(tmp_path, tmp_path / "y", "int8")
    # codes without their scale are refused with the tensor's name
    state = read_state_dict(out)
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = torch.zeros(state[name].shape, dtype=torch.int8)
    from qurl.models.hf import write_state_dict

    write_state_dict(out, state)
    with pytest.raises(ValueError, match=f"{name} has 8-bit codes but no"):
        read_8bit(out)
