"""qurl.research.studies.engine_noise on a tiny checkpoint: exact invariances give exactly zero, the KL it
reports equals torch's own KL on the engines' logits, and norm-gain jitter moves no weight code."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from qurl.config import load_config
from qurl.engines.local import LocalEngine
from qurl.models.hf import build_model, read_state_dict
from qurl.research.studies.engine_noise import compare_engines, main, perturbations, worked_answer_pairs
from qurl.research.studies.uaq_codes import code_changes

MICRO = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "micro", "tiny", seed=0, overrides=MICRO)


@pytest.fixture(scope="module")
def pairs(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    got = worked_answer_pairs(load_config("cpu-tiny"), tok, 6)
    assert len(got) == 6 and all(a[-1] == tok.eos_token_id for _, a in got)
    return got


def test_perturbations_move_what_they_say(ckpt):
    state = read_state_dict(ckpt)
    before = {k: v.clone() for k, v in state.items()}
    v = perturbations(state, scales=(2.0,), jitter=(1e-2,))
    assert set(v) == {"uaq s=2", "linear jitter 0.01", "norm jitter 0.01"}
    assert all(torch.equal(state[k], before[k]) for k in state)  # input untouched
    assert code_changes(state, v["uaq s=2"])["all"] == 0.0
    assert code_changes(state, v["norm jitter 0.01"])["all"] == 0.0  # gains only: no code moves
    assert code_changes(state, v["linear jitter 0.01"])["all"] > 0.0
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(v["norm jitter 0.01"][norm], state[norm])
    assert torch.equal(v["linear jitter 0.01"][norm], state[norm])
    assert torch.equal(v["norm jitter 0.01"]["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_compare_engines_zero_where_exact_and_equal_to_torch_kl(ckpt, pairs, one_thread):
    state = read_state_dict(ckpt)
    out = compare_engines(ckpt, perturbations(state, scales=(2.0, 1.5), jitter=(1e-2,)), pairs, "int8")
    assert list(out)[:2] == ["reference", "fp32"]
    assert out["reference"]["kl_vs_ref"] == 0.0 and out["reference"]["dlogp"] == 0.0
    assert out["fp32"]["kl_vs_fp32"] == 0.0
    # s = 2 divides exactly: the int8 engine computes the same bits
    assert out["uaq s=2"]["kl_vs_ref"] == 0.0 and out["uaq s=2"]["dlogp"] == 0.0
    assert out["uaq s=2"]["kl_vs_fp32"] == out["reference"]["kl_vs_fp32"]
    assert out["linear jitter 0.01"]["kl_vs_ref"] > 0.0
    # the reported KL(fp32 ‖ int8) is torch's kl_div on the two engines' logits, per answer token
    ref, fp = LocalEngine(ckpt, precision="int8"), LocalEngine(ckpt, precision="bf16")
    total = sum(F.kl_div(torch.log_softmax(ref.token_logits(p, a).double(), -1),
                         torch.log_softmax(fp.token_logits(p, a).double(), -1),
                         log_target=True, reduction="sum").item() for p, a in pairs)
    assert out["reference"]["kl_vs_fp32"] == pytest.approx(total / sum(len(a) for _, a in pairs), rel=1e-9)
    assert out["reference"]["kl_vs_fp32"] > 0.0
    # without quantization UAQ is the same function up to fp32 rounding
    fp_out = compare_engines(ckpt, perturbations(state, scales=(1.5,), jitter=()), pairs, "bf16")
    assert fp_out["uaq s=1.5"]["kl_vs_ref"] < 1e-9
    assert abs(fp_out["uaq s=1.5"]["dlogp"]) < 1e-4


def test_cli_prints_one_row_per_engine(ckpt, capsys, one_thread):
    assert main([str(ckpt), "--preset", "cpu-tiny", "--n", "3", "--scales", "2", "--jitter", "1e-3"]) == 0
    rows = {r["engine"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(rows) == ["reference", "fp32", "uaq s=2", "linear jitter 0.001", "norm jitter 0.001"]
    assert all(r["questions"] == 3 for r in rows.values())
    assert rows["uaq s=2"]["kl_vs_ref"] == 0.0 and rows["uaq s=2"]["codes_moved"] == 0.0
    assert rows["norm jitter 0.001"]["codes_moved"] == 0.0
    assert rows["fp32"]["precision"] == "fp32" and rows["reference"]["precision"] == "int8"


def test_scoring_nothing_is_refused(ckpt):
    with pytest.raises(ValueError, match="no .* pairs"):
        compare_engines(ckpt, {}, [], "int8")
