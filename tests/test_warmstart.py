"""The supervised warm start shares the learner's learning-rate curve (qurl/algo/schedule.py) and
nothing else changed: its rates, and a warm start run with them, are those of the formula it had
before, to the bit (qurl/models/warmstart.py's docstring says why its AdamW stays its own)."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import torch

from qurl.config import OptimConfig
from qurl.learner.optim import lr_at
from qurl.models import warmstart as ws
from qurl.models.hf import build_model, read_state_dict

MICRO = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128}
PAIRS = [(f"{a}+{b}=", f"{a + b}") for a in range(10) for b in range(10)]


def _warmstart_before(step: int, steps: int, lr: float) -> float:
    """The warm start's own schedule before it was shared (verbatim)."""
    warm = max(1, steps // 10)
    if step < warm:
        return lr * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def _learner_before(optim: OptimConfig, step: int, total_steps: int) -> float:
    """The learner's lr_at before the curve moved to qurl/algo/schedule.py (verbatim)."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    span = max(1, total_steps - optim.warmup_steps)
    p = min(1.0, (step - optim.warmup_steps) / span)
    return optim.lr * 0.5 * (1.0 + math.cos(math.pi * p))


def test_both_trainers_rates_are_their_old_formulas_to_the_bit():
    rng = random.Random(0)
    lrs = [3e-3, 1e-3, 3e-5, 1e-30, 1.0] + [10 ** rng.uniform(-9, 0) for _ in range(20)]
    for lr in lrs:
        for steps in list(range(1, 30)) + [40, 60, 250, 1000]:
            assert [ws._lr_at(k, steps, lr).hex() for k in range(steps)] == \
                [_warmstart_before(k, steps, lr).hex() for k in range(steps)], (lr, steps)
            for warmup in (0, 1, 3, steps):
                for schedule in ("constant", "cosine"):
                    o = replace(OptimConfig(), lr=lr, warmup_steps=warmup, schedule=schedule)
                    assert [lr_at(o, k, steps).hex() for k in range(steps + 2)] == \
                        [_learner_before(o, k, steps).hex() for k in range(steps + 2)]


def test_a_warm_start_is_the_one_of_the_old_schedule_bit_for_bit(tmp_path, monkeypatch, one_thread):
    init = build_model(tmp_path / "init", "tiny", seed=0, overrides=MICRO)
    kw = dict(steps=12, lr=3e-3, batch_size=8, seed=5, num_threads=1)
    now = read_state_dict(ws.sft_warmstart(init, PAIRS, out_dir=tmp_path / "now", **kw))
    monkeypatch.setattr(ws, "_lr_at", _warmstart_before)
    before = read_state_dict(ws.sft_warmstart(init, PAIRS, out_dir=tmp_path / "before", **kw))
    start = read_state_dict(init)
    assert sorted(now) == sorted(before)
    assert all(torch.equal(now[k], before[k]) for k in now)
    assert any(not torch.equal(now[k], start[k]) for k in start)  # it did train
