"""Issue 60 item 4: the mismatch alarm (qurl/train/alarm.py) — closed-form checks of the pure
rule, then the alarm in a training run: quiet on a healthy tiny run, and firing (and, with
deploy.alarm.stop, stopping the run in one line) on a fault the digests cannot see — a quantizer
that writes each row's per-channel scale to the wrong row, injected BEFORE the digest is taken, so
the engine faithfully holds and verifies wrong weights (`sync/verified` stays 1).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from qurl.train.alarm import MismatchAlarm


def _feed(alarm: MismatchAlarm, values: list[float]) -> list:
    return [alarm.update(v, step=i + 1) for i, v in enumerate(values)]


def test_warmup_then_fires_once_at_the_nth_breach_in_a_row():
    a = MismatchAlarm(factor=10, steps=3, warmup=3)
    out = _feed(a, [1.0, 2.0, 3.0, 2.5, 25.0, 30.0, 40.0, 50.0, 1.0])
    # warm-up: no verdict, ratio NaN; history median of [1,2,3] = 2, then [1,2,3,2.5] = 2.25
    assert all(math.isnan(v.record["alarm/kl_ratio"]) for v in out[:3])
    assert out[3].record["alarm/kl_ratio"] == 2.5 / 2.0 and out[3].record["alarm/kl"] == 0.0
    # 25 > 10 x 2.25: breaches do not enter the history, so the median stays 2.25
    assert [v.record["alarm/kl_streak"] for v in out[4:8]] == [1.0, 2.0, 3.0, 4.0]
    assert [v.record["alarm/kl_median"] for v in out[4:8]] == [2.25] * 4
    assert [v.fired for v in out] == [False] * 6 + [True, False, False]
    assert [v.record["alarm/kl"] for v in out[4:]] == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert out[6].message.startswith("step 7: mismatch alarm: KL(behav||prox) = 40 is above "
                                     "10 x its running median 2.25 for 3 steps in a row")
    assert out[-1].record["alarm/kl_fired"] == 1.0 and out[-1].record["alarm/kl_streak"] == 0.0


def test_an_interrupted_streak_does_not_fire_and_nan_is_a_breach():
    a = MismatchAlarm(factor=4, steps=2, warmup=2)
    out = _feed(a, [1.0, 1.0, 5.0, 1.0, 5.0, float("nan")])
    assert [v.fired for v in out] == [False] * 5 + [True]  # 5, (1 resets), 5, NaN
    assert out[2].record["alarm/kl_ratio"] == 5.0


def test_exactly_factor_is_not_a_breach_and_a_zero_median_uses_the_floor():
    a = MismatchAlarm(factor=2, steps=1, warmup=1)
    assert not _feed(a, [3.0, 6.0])[1].fired  # 6 = 2 x 3: not above
    z = MismatchAlarm(factor=10, steps=1, warmup=1, window=1, floor=1e-6)
    out = _feed(z, [0.0, 5e-6, 6e-5])  # 5e-6 <= 10 x max(0, 1e-6); then 6e-5 > 10 x 5e-6
    assert [v.fired for v in out] == [False, False, True]


def test_state_round_trip_and_bad_settings():
    a = MismatchAlarm(factor=3, steps=2, warmup=2)
    _feed(a, [1.0, 1.0, 9.0])
    b = MismatchAlarm(factor=3, steps=2, warmup=2)
    b.load_state_dict(a.state_dict())
    assert b.update(9.0).fired and not a.update(1.0).fired
    for bad in [dict(factor=1.0, steps=1), dict(factor=float("nan"), steps=1),
                dict(factor=2, steps=0), dict(factor=2, steps=1, warmup=5, window=4)]:
        with pytest.raises(ValueError, match="alarm"):
            MismatchAlarm(**bad)


# ------------------------------------------------------------------ in a training run

@pytest.fixture(scope="module")
def runs_root(runs_dir):
    from pipeline_helpers import use_free_dist_port

    use_free_dist_port()
    return runs_dir("runs")


def _wrong_row_scales(real):
    """quantize_per_channel whose scales land one row off (row i gets row i+1's scale)."""
    def faulty(w, fmt, out=None):
        codes, scale = real(w, fmt, out=out)
        scale.copy_(torch.roll(scale.clone(), 1, dims=0))
        return codes, scale
    return faulty


def _records(run_dir) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"]


@pytest.mark.slow  # two 5-step tiny runs: minutes on a loaded 2-core machine
@pytest.mark.timeout(900)
def test_alarm_quiet_on_a_healthy_run_and_fires_on_a_quantizer_fault(runs_root, monkeypatch,
                                                                     capsys):
    from pipeline_helpers import tiny_cfg
    from qurl.errors import RunHalted
    from qurl.weights.publish import WeightSync
    from qurl.commands.train import train

    extra = {"rollout.precision": "int8", "deploy.alarm.steps": 2, "deploy.ckpt_every": 0,
             "data.eval_size": 4}
    healthy = tiny_cfg(runs_root, "healthy", 5, **extra)
    train(healthy)
    recs = _records(runs_root / "healthy")
    assert [r["alarm/kl"] for r in recs] == [0.0] * 5 and recs[-1]["alarm/kl_fired"] == 0.0
    assert "mismatch alarm" not in capsys.readouterr().out
    quiet = [(r["kl_behav_prox"], r["alarm/kl_ratio"]) for r in recs[3:]]  # NaN: null in JSON

    import qurl.quant.named as named
    import qurl.weights.arena as arena
    real_push = WeightSync.push

    def push(self, chunks, engine, version):  # the fault starts with the weights of version 3
        if version == 3:
            monkeypatch.setattr(arena, "quantize_per_channel",
                                _wrong_row_scales(arena.quantize_per_channel))
            monkeypatch.setattr(named, "quantize_per_channel",
                                _wrong_row_scales(named.quantize_per_channel))
        return real_push(self, chunks, engine, version)

    monkeypatch.setattr(WeightSync, "push", push)
    faulty = tiny_cfg(runs_root, "faulty", 5, **extra, **{"deploy.alarm.stop": True})
    with pytest.raises(RunHalted, match="step 5: mismatch alarm: KL.*2 steps in a row"):
        train(faulty)
    recs = _records(runs_root / "faulty")
    with capsys.disabled():  # the numbers docs/delta_sync.md quotes (run with -s)
        print("\nhealthy kl_behav_prox / alarm/kl_ratio steps 4-5:", quiet,
              "\nfaulty steps 1-5:", [(r["kl_behav_prox"], r["alarm/kl_ratio"]) for r in recs])
    assert all(r["sync/verified"] == 1.0 for r in recs)  # the digests vouch for the wrong weights
    assert [r["alarm/kl"] for r in recs] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert recs[3]["alarm/kl_streak"] == 1.0 and recs[-1]["alarm/kl_fired"] == 1.0
    assert capsys.readouterr().out.count("mismatch alarm") == 1
