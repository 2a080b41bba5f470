"""qurl/models/fits.py: a checkpoint the run's layout cannot split is refused before any rank or
server starts, in one line naming the sizes (no model download: config fields only)."""
from __future__ import annotations

import json

import pytest

from qurl.cli import main
from qurl.errors import InputError
from qurl.models.fits import check_fits, check_learner_tp, fp8_block_problem, read_fields

# SmolLM2-135M-Instruct's config.json fields that matter here (Llama, GQA 9/3 heads of 64)
SMOLLM2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152, "num_hidden_layers": 30,
           "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 100000.0}


def test_learner_tp_must_divide_heads_kv_heads_and_ffn() -> None:
    for tp in (1, 3):
        check_learner_tp(SMOLLM2, tp, "smollm2")
    with pytest.raises(InputError) as e:
        check_learner_tp(SMOLLM2, 2, "smollm2")
    msg = str(e.value)
    assert "\n" not in msg and "learner.tp=2" in msg
    assert "num_attention_heads=9" in msg and "num_key_value_heads=3" in msg
    with pytest.raises(InputError, match="num_key_value_heads=2"):  # tiny: 8 heads over 2 KV heads
        check_learner_tp(read_fields("tiny"), 4, "tiny")
    check_learner_tp(read_fields("tiny"), 2, "tiny")


def test_fp8_block_follows_sglangs_fused_gemm_rule() -> None:
    # q_proj 576 rows = 4.5 blocks of 128, and q is not the last part of the fused qkv
    assert "q_proj has 576" in fp8_block_problem(SMOLLM2, 1)
    # 12 heads / 4 KV heads of 64 (small): q 768, k 256 whole blocks; v (last) may be anything
    assert fp8_block_problem(read_fields("small"), 1) is None
    # per rank at sglang.tp=2: k 128 rows, v 128, gate/up 1536, o_proj input 384, down input 1536
    assert fp8_block_problem(read_fields("small"), 2) is None
    # tiny (heads of 32): k_proj 64 rows
    assert "k_proj has 64" in fp8_block_problem(read_fields("tiny"), 1)
    # split across sglang.tp=4 ranks every part counts: q 16 x 64 -> 256 rows per rank (whole
    # blocks) but k 4 x 64 -> 64; the same model on one rank is fine (k 256, v last)
    gqa = dict(read_fields("small"), num_attention_heads=16, head_dim=64, num_key_value_heads=4)
    assert fp8_block_problem(gqa, 1) is None
    assert "k_proj has 64" in fp8_block_problem(gqa, 4)


def test_cli_refuses_before_ranks(tmp_path, capsys) -> None:
    ckpt = tmp_path / "smol"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(SMOLLM2))
    runs = tmp_path / "runs"
    for sets, want in ((["learner.tp=2"], "num_attention_heads=9"),
                       (["rollout.engine=sglang", "rollout.precision=fp8_block"], "q_proj has 576")):
        argv = ["train", "--set", f"model.base={ckpt}", "--set", f"deploy.dir={runs}"]
        for kv in sets:
            argv += ["--set", kv]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and want in err, err
    assert not runs.exists()  # refused before any run directory
    with pytest.raises(InputError, match="cannot read config.json"):
        check_fits(str(tmp_path / "missing"), learner_tp=1, engine="local", precision="int8",
                   sglang_tp=1)


# an untied Qwen3-MoE: the one MoE a real SGLang server ran end to end (tests/test_sglang_real_moe.py)
QWEN3_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
             "tie_word_embeddings": False}


@pytest.mark.parametrize("change,named", [
    ({"precision": "int8"}, "rollout.precision=int8"),
    ({"sglang_tp": 2}, "sglang.tp=2"),
    ({"fields": dict(QWEN3_MOE, tie_word_embeddings=True)}, "a tied lm_head"),
    ({"fields": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}},
     "other than Qwen3-MoE"),
])
def test_a_moe_on_sglang_runs_only_as_the_real_server_ran_it(change, named) -> None:
    from qurl.models.fits import check_moe_run

    args = dict(learner_tp=1, engine="sglang", precision="bf16", sglang_tp=1,
                routing_replay="off", fields=QWEN3_MOE)
    check_moe_run("m", **args)  # untied Qwen3-MoE, bf16, sglang.tp 1, no replay: runs
    check_moe_run("m", **dict(args, routing_replay="rollout"))  # replaying the server's routes too
    check_moe_run("m", **dict(args, engine="local", precision="int8"))
    with pytest.raises(InputError) as e:
        check_moe_run("m", **dict(args, **change))
    msg = str(e.value)
    assert "\n" not in msg and named in msg and "inside SGLang" in msg
    with pytest.raises(InputError, match="tied lm_head"):  # the tiny-qwen3-moe preset is tied
        check_fits("tiny-qwen3-moe", learner_tp=1, engine="sglang", precision="bf16", sglang_tp=1)
