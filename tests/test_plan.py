"""The learner memory plan printed before launch (qurl/learner/memory_plan.py): the paper presets fit an
80 GB GPU at their own lengths, a plan that cannot hold one row is refused in one line naming the
fields to change, and the plan moves the way the cost model says it should."""
from __future__ import annotations

import pytest

from qurl.config import load_config
from qurl.commands.launch import main_launch
from qurl.learner import memory_plan
from qurl.learner.memory_plan import KNOWN_SHAPES


def plan_ranks(cfg, fields, gpu_bytes):
    return memory_plan.plan_ranks(cfg.model, cfg.learner, cfg.rollout, cfg.deploy, fields, gpu_bytes,
                                  kl_coef=cfg.algo.kl_coef)


def plan_text(cfg, memory_bytes, memory):
    return memory_plan.plan_text(cfg.model, cfg.learner, cfg.rollout, cfg.deploy, memory_bytes,
                                 memory, kl_coef=cfg.algo.kl_coef)


@pytest.mark.parametrize("preset,L", [("paper-deepscaler-1.5b", 8704), ("paper-dapo-7b", 20992)])
def test_the_paper_presets_fit_an_80gb_gpu(capsys, preset: str, L: int) -> None:
    assert main_launch(["--preset", preset, "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = [line for line in out.splitlines() if line.startswith("#   rank")]
    assert plan and f"L = {L} tokens" in out and "DOES NOT FIT" not in out
    assert all("fits, room for" in line for line in plan)


def test_a_plan_that_cannot_hold_one_row_is_refused_in_one_line(capsys) -> None:
    rc = main_launch(["--preset", "paper-dapo-7b", "--dry-run", "--set", "learner.recompute=none"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "learner rank 0" in err and "learner.recompute=full (now none)" in err
    assert "rollout.max_new_tokens" in err
    # fewer learner ranks: the refusal names the next TP that divides 28 heads and 4 KV heads
    rc = main_launch(["--preset", "paper-dapo-7b", "--dry-run", "--set", "learner.tp=2"])
    err = capsys.readouterr().err
    assert rc == 2 and "learner.tp=4 (now 2)" in err
    # the 1.5B model's 2 KV heads allow no TP above 2: not suggested
    rc = main_launch(["--preset", "paper-deepscaler-1.5b", "--dry-run", "--gpu-memory-gb", "40"])
    err = capsys.readouterr().err
    assert rc == 2 and "learner.tp" not in err and "learner.recompute=full" in err


def test_plan_moves_with_attention_recompute_tp_and_rank_zero_sync() -> None:
    fields = KNOWN_SHAPES["Qwen/Qwen2.5-Math-7B"]
    cfg = load_config("paper-dapo-7b")

    def row(**sets) -> float:
        c = load_config("paper-dapo-7b", sets=[f"{k.replace('__', '.')}={v}" for k, v in sets.items()])
        return plan_ranks(c, fields, 80e9)[0].row

    full, none = row(), row(learner__recompute="none")
    unfused = row(learner__recompute="none", deploy__ranks__attention="unfused")
    assert full < none < unfused
    # unfused attention keeps [heads/TP, L, L] probabilities: ~28/4 x 20992^2 x 4 bytes x 28 layers
    assert unfused - none > 28 / 4 * 20992**2 * 4 * 28 * 0.9
    plans = plan_ranks(cfg, fields, 80e9)
    assert plans[0].sync > 0 and all(p.sync == 0 for p in plans[1:])  # the sync staging: rank 0
    assert plans[0].rows <= plans[1].rows
    halved = plan_ranks(load_config("paper-dapo-7b", sets=["learner.tp=8"]), fields, 80e9)[1]
    assert halved.optimizer == pytest.approx(plans[1].optimizer / 2, rel=0.02)


def test_an_unknown_hub_model_skips_the_plan_saying_why() -> None:
    cfg = load_config("paper-dapo-7b", sets=["model.base=org/not-here"])
    text, refused = plan_text(cfg, 80e9, "GPU")
    assert refused is None and "skipped" in text and "org/not-here" in text
