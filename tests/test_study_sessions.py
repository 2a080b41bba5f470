"""`qurl study ablation` across sessions: finished-run detection, committed arms reused (not run
again), a table rebuilt from committed files alone, a committed arm of another config refused, and
an interrupted arm resumed from its checkpoint — with real `qurl train` processes on the tiny model."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline_helpers import TIMING, tiny_cfg
from qurl.config import ConfigError, override
from qurl.studies.ablation import ablation
from qurl.studies.store import FILES, arm_dir, finished
from qurl.train.metrics_log import read_metrics


def test_finished_needs_every_step_and_the_final_eval():
    ev = lambda s: {"kind": "eval", "step": s}  # noqa: E731
    tr = lambda s: {"kind": "train", "step": s}  # noqa: E731
    assert finished([ev(0), tr(1), tr(2), ev(2)], 2)
    assert finished([ev(0), tr(1), ev(1), tr(2), ev(2)], 2)  # an intermediate eval
    assert not finished([ev(0), tr(1), tr(2)], 2)  # cut before the final eval
    assert not finished([ev(0), tr(1), ev(1)], 2)  # an eval at a checkpoint, not the last step
    assert not finished([ev(0), tr(1), tr(2), ev(2)], 3)  # run.steps says more
    assert not finished([ev(0), tr(2), ev(2)], 2)  # a step missing
    assert not finished([], 2)


def _strip(rec: dict) -> dict:
    """A record without its timings and wall-clock rates (which differ between any two runs)."""
    return {k: v for k, v in rec.items() if not any(t in k for t in TIMING)}


@pytest.mark.slow
def test_study_spans_sessions(tmp_path, runs_dir, capsys):
    """Three 2-step `qurl train` processes: bf16 (session 1), int8-mis (session 2), the resume."""
    cfg = tiny_cfg(tmp_path, "unused", 2, **{"deploy.torch_threads": 1, "eval.samples": 2})
    out, runs = tmp_path / "study", tmp_path / "runs"
    (runs / "seed0").mkdir(parents=True)  # the session's shared cache of warm-started base models
    (runs / "seed0" / "_base").symlink_to(runs_dir("study-base") / "_base", target_is_directory=True)

    ablation(cfg, out, seeds=[0], arms=["bf16-ppo"], runs_dir=runs)
    assert sorted(p.name for p in arm_dir(out, "bf16-ppo", 0).iterdir()) == sorted(FILES)
    first = (arm_dir(out, "bf16-ppo", 0) / "metrics.jsonl").read_text()
    assert (out / "ablation_step.png").stat().st_size > 0

    # a new session: the run directories are gone, only the committed files remain
    shutil.rmtree(runs / "seed0" / "bf16-ppo")
    md = ablation(cfg, out, seeds=[0], arms=["int8-mis"], runs_dir=runs).read_text()
    assert not (runs / "seed0" / "bf16-ppo").exists()  # committed: not run again
    assert (arm_dir(out, "bf16-ppo", 0) / "metrics.jsonl").read_text() == first
    assert sorted(p.name for p in arm_dir(out, "int8-mis", 0).iterdir()) == sorted(FILES)
    # the table holds every committed arm: the earlier session's bf16 too, as the baseline
    assert "| bf16-ppo | 1 | 2 |" in md and "| int8-mis | 1 | 2 |" in md
    assert "avg@2 over 8 held-out questions" in md  # Avg@k is the headline when measured
    mis = read_metrics(arm_dir(out, "int8-mis", 0) / "metrics.jsonl")
    keys = {"mask_frac_high", "cut/geomask", "is_weight_mean"}
    assert all(keys <= set(r) for r in mis if r["kind"] == "train")
    ablation(cfg, out, seeds=[0], arms=["bf16-ppo", "int8-mis"], runs_dir=runs)  # nothing to run
    assert "seed 0 bf16-ppo: committed in" in capsys.readouterr().out
    assert not (runs / "seed0" / "bf16-ppo").exists()

    # final evaluations: int8-mis's last checkpoint is scored again (its greedy answers are the
    # last training evaluation's: the same weights and questions); bf16's run directory is gone,
    # so the table keeps the training evaluations for both
    md_final = ablation(cfg, out, seeds=[0], arms=["int8-mis"], runs_dir=runs,
                        final_eval=3).read_text()
    said = capsys.readouterr().out
    assert "seed 0 int8-mis: final evaluation (avg@3): evaluated" in said
    assert "seed 0 bf16-ppo: final evaluation (avg@3): no run directory" in said
    final = json.loads((arm_dir(out, "int8-mis", 0) / "final_eval.json").read_text())
    last = [r for r in read_metrics(arm_dir(out, "int8-mis", 0) / "metrics.jsonl")
            if r["kind"] == "eval"][-1]
    assert (final["k"], final["step"], final["record"]["n"]) == (3, 2, last["n"])
    assert final["record"]["eval/mean/greedy"] == last["eval/mean/greedy"]
    counts = final["record"]["eval_counts"]  # right answers per question, of 3 / of 1
    assert len(counts["synthetic/avg@3"]) == last["n"] and max(counts["synthetic/avg@3"]) <= 3
    assert sum(counts["synthetic/avg@3"]) / (3 * last["n"]) == final["record"]["eval/mean/avg@3"]
    assert sum(counts["synthetic/greedy"]) / last["n"] == last["eval/mean/greedy"]
    assert md_final == md

    # another setting is refused in one line naming the field, nothing overwritten
    with pytest.raises(ConfigError, match=r"run\.steps: 2 there, 3 here"):
        ablation(override(cfg, {"run.steps": 3}), out, seeds=[0], arms=["bf16-ppo"], runs_dir=runs)

    # the table from the committed files alone (no config needed beyond the defaults)
    (out / "ablation.md").unlink()
    again = ablation(override(cfg, {"run.steps": 7}), out, seeds=[0], table_only=True).read_text()
    assert again == md

    # an arm interrupted after step 1 (checkpoint kept, run dir still there) is resumed:
    # the marker on its step-1 record survives (a restart would have removed the directory) and
    # step 2 equals the uninterrupted run's
    run = runs / "seed0" / "int8-mis"
    whole = read_metrics(run / "metrics.jsonl")
    shutil.rmtree(run / "ckpt" / "step_000002")
    (run / "ckpt" / "latest").write_text("step_000001")
    cut = [dict(r, marker=1) if r["kind"] == "train" else r for r in whole if r["step"] <= 1]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cut))
    shutil.rmtree(arm_dir(out, "int8-mis", 0))
    ablation(cfg, out, seeds=[0], arms=["int8-mis"], runs_dir=runs)
    assert "seed 0 int8-mis: resumed" in capsys.readouterr().out
    resumed = read_metrics(arm_dir(out, "int8-mis", 0) / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in resumed] == [(r["kind"], r["step"]) for r in whole]
    assert resumed[1]["marker"] == 1
    for a, b in zip(resumed[2:], whole[2:]):
        a, b = _strip(a), _strip(b)
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(b[k], float):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
            else:
                assert a[k] == b[k], (a["step"], k)
