"""A mixture of experts at scale: Qwen3-30B-A3B's known shape, the MoE-aware memory plan
(qurl/learner/memory_plan.py) and the qwen3-30b-a3b preset, which `qurl launch --dry-run` refuses
in one line today after planning it (TP 1 x DP 16 x EP 16 fits; qurl/models/fits.py
check_moe_run refuses 8-bit MoE servers, sglang.tp=2 and replay on SGLang), and the plan's
refusal of a rank holding all 128 experts, which learner.ep divides.

References: the model card's published counts (30.5B parameters, 3.3B activated, 29.9B without
the embeddings) and a tiny Qwen3-MoE built by transformers, whose parameter count the plan must
equal exactly."""
from __future__ import annotations

import pytest

from qurl.commands import launch
from qurl.commands.launch import main_launch
from qurl.config import load_config
from qurl.errors import InputError
from qurl.learner.memory_plan import (KNOWN_SHAPES, _params, model_fields, param_counts,
                                      token_cost_from_fields)
from qurl.models.fits import check_moe_run, read_fields

A3B = KNOWN_SHAPES["Qwen/Qwen3-30B-A3B"]


def test_a3b_counts_match_the_model_card() -> None:
    total, active = param_counts(A3B)
    assert total == pytest.approx(30.5e9, rel=0.01)
    assert active == pytest.approx(3.3e9, rel=0.03)
    embeddings = 2 * A3B["vocab_size"] * A3B["hidden_size"]  # untied embedding and head
    assert total - embeddings == pytest.approx(29.9e9, rel=0.01)
    # a token's MLP activations are those of its 8 routed experts, not of all 128
    assert token_cost_from_fields(A3B, tp=1, elem=2, attention="flash", recompute="none").ffn == 8 * 768


def test_the_planned_count_of_a_built_tiny_moe_is_exact(tmp_path) -> None:
    """The plan's count of tiny-qwen3-moe equals the module transformers builds from it (router,
    every expert, q/k norms, tied embedding once), and the per-token count equals the module's
    minus the experts a token does not run."""
    from transformers import AutoModelForCausalLM

    from qurl.models.hf import build_model

    model = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / "m", "tiny-qwen3-moe"))
    fields = read_fields("tiny-qwen3-moe")
    built = sum(p.numel() for p in model.parameters())
    total, active = param_counts(fields)
    assert total == built
    assert _params(fields, 1, fields["vocab_size"])[0] == built  # one rank at TP 1 holds it all
    E, k = fields["num_experts"], fields["num_experts_per_tok"]
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert active == built - experts * (E - k) // E
    # the experts divide over expert-parallel ranks (learner.ep)
    assert _params(fields, 1, fields["vocab_size"], ep=4)[0] == built - experts * 3 // 4


def test_the_a3b_preset_is_refused_in_one_line_before_anything_starts(capsys, monkeypatch) -> None:
    cfg = load_config("qwen3-30b-a3b")
    with pytest.raises(InputError) as moe:  # the check every MoE run gets (qurl train: check_fits)
        check_moe_run(cfg.model.base, learner_tp=cfg.learner.tp, engine=cfg.rollout.engine,
                      precision=cfg.rollout.precision, sglang_tp=cfg.sglang.tp,
                      routing_replay=cfg.algo.routing_replay, fields=model_fields(cfg.model.base))
    monkeypatch.setattr(launch, "plan", lambda *a, **k: pytest.fail("placement planned"))
    monkeypatch.setattr(launch, "run_node", lambda *a, **k: pytest.fail("a node started"))
    for argv in (["--dry-run"], ["--nodes", "h0,h1", "--node-rank", "0"]):
        assert main_launch(["--preset", "qwen3-30b-a3b", *argv]) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert lines == [f"qurl launch: error: {moe.value}"]  # the memory plan fits
        for missing in ("rollout.precision=int8", "sglang.tp=2"):
            assert missing in lines[0], missing
        assert "routing_replay" not in lines[0]  # the engine asks SGLang for its routes
        assert "learner.tp=" not in lines[0]  # TP 1 x DP 16 x EP 16: nothing to say
        # the memory plan, per rank, with the experts every rank holds
        assert "#   ranks 1-15" in out and out.count(": fits") == 2
        assert ("every rank holds 3.35B parameters, 1.81B of them its 8 of the 128 experts of "
                "every layer (learner.ep=16") in out


def test_a_moe_run_check_moe_run_accepts_is_refused_by_the_memory_plan(capsys) -> None:
    """At TP 1 on the local engine check_moe_run has nothing to say; 30.5B parameters per rank
    cannot fit, and the plan's one line names the experts and learner.ep, not learner.tp (which a
    MoE cannot use); at learner.ep = learner.dp = 8 every rank holds 16 of the 128 experts (5.16B
    parameters in all), which the plan prints and the refusal names."""
    rc = main_launch(["--preset", "qwen3-30b-a3b", "--set", "learner.dp=2", "--set", "learner.ep=1",
                      "--set", "rollout.engine=local", "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("qurl launch: error: learner rank 0 needs")
    assert "128 experts" in err[0] and "expert parallelism" in err[0]
    assert "set learner.ep=2 (now 1" in err[0] and "learner.tp=" not in err[0]
    rc = main_launch(["--preset", "qwen3-30b-a3b", "--set", "learner.dp=8",
                      "--set", "learner.ep=8", "--set", "rollout.engine=local", "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 2 and "its 16 of the 128 experts of every layer" in err
    assert "raise learner.dp" in err  # ep = dp: no larger learner.ep to suggest
    from qurl.learner.memory_plan import plan_text

    cfg = load_config("qwen3-30b-a3b", sets=["learner.dp=8", "learner.ep=8"])
    text, _ = plan_text(cfg.model, cfg.learner, cfg.rollout, cfg.deploy, 80e9, "GPU",
                        kl_coef=cfg.algo.kl_coef)
    assert ("every rank holds 5.16B parameters, 3.62B of them its 16 of the 128 experts of every "
            "layer (learner.ep=8; ") in text
