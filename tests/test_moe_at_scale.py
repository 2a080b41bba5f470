"""A mixture of experts at scale: Qwen3-30B-A3B's known shape and the MoE-aware memory plan
(qurl/learner/memory_plan.py).

References: the model card's published counts (30.5B parameters, 3.3B activated, 29.9B without
the embeddings) and a tiny Qwen3-MoE built by transformers, whose parameter count the plan must
equal exactly."""
from __future__ import annotations

import pytest

from qurl.learner.memory_plan import KNOWN_SHAPES, _params, param_counts, token_cost_from_fields
from qurl.models.fits import read_fields

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
    # the experts divide over expert-parallel ranks (the divisor expert parallelism would use)
    assert _params(fields, 1, fields["vocab_size"], ep=4)[0] == built - experts * 3 // 4
