"""`qurl study ablation` across sessions: finished-run detection, committed arms reused (not run
again), a table rebuilt from committed files alone, a committed arm of another config refused, an
interrupted arm resumed from its checkpoint, and a study lengthened (a finished arm continued to
more steps) — with real `qurl train` processes on the tiny model."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from pipeline_helpers import TIMING, tiny_cfg

from qurl.config import ConfigError, override
from qurl.research.studies.ablation import ablation, arm_configs
from qurl.research.studies.runner import run_to_end, train_command
from qurl.research.studies.store import (FILES, START, arm_dir, check_start, extends, finished, start_record,
                                starts)
from qurl.research.studies.page import starts_markdown
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


def test_extends_only_where_the_first_steps_are_the_same(tmp_path):
    short = tiny_cfg(tmp_path, "arm", 20, **{"run.eval_every": 10})
    assert extends(short, override(short, {"run.steps": 40}))
    assert extends(short, override(short, {"run.steps": 40, "deploy.torch_threads": 1}))  # where
    assert not extends(short, short)  # the same run
    assert not extends(override(short, {"run.steps": 40}), short)  # fewer steps
    assert not extends(short, override(short, {"run.steps": 40, "optim.lr": 1e-4}))
    cosine = override(short, {"optim.schedule": "cosine"})  # its decay spans run.steps
    assert not extends(cosine, override(cosine, {"run.steps": 40}))
    stale = override(short, {"rollout.max_staleness": 1})  # generates ahead near its end
    assert not extends(stale, override(stale, {"run.steps": 40}))
    odd = override(short, {"run.steps": 25})  # ended on an evaluation a 40-step run lacks
    assert not extends(odd, override(short, {"run.steps": 40}))
    final_only = override(short, {"run.eval_every": 0})  # the same: its final one at step 20
    assert not extends(final_only, override(final_only, {"run.steps": 40}))


def test_start_record_hashes_the_starting_weights(tmp_path):
    """SHA-256 over the base's weight files in name order, with the warm start's record; None for
    a run that used a checkpoint as given (no base_model/ of its own)."""
    import hashlib

    base = tmp_path / "run" / "base_model"
    base.mkdir(parents=True)
    (base / "model-00002.safetensors").write_bytes(b"second")
    (base / "model-00001.safetensors").write_bytes(b"first" * 10_000_000)  # 50 MB: chunked
    (base / "warmstart.json").write_text('{"steps": 20, "losses": [1.8, 0.06]}')
    rec = start_record(tmp_path / "run")
    assert rec == {"sha256": hashlib.sha256(b"first" * 10_000_000 + b"second").hexdigest(),
                   "warmstart": {"steps": 20, "losses": [1.8, 0.06]}}
    assert start_record(tmp_path / "other") is None


def test_a_warm_start_at_another_precision_is_refused_before_training(tmp_path):
    """The seed's committed arms recorded their start (base.json); a base built on a CPU without
    native bf16 (warm-started in fp32) is another model and is refused before any step, naming
    the precision; the same precision with other bits (another CPU's kernels) is a warning."""
    import hashlib

    def base(name: str, weights: bytes, bf16: bool) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors").write_bytes(weights)
        (d / "warmstart.json").write_text(json.dumps({"steps": 20, "bf16_autocast": bf16}))
        return d

    out = tmp_path / "study"
    assert check_start(out, 4, base("first", b"w0", True)) is None  # nothing committed yet
    (out / "bf16-ppo" / "seed4").mkdir(parents=True)
    (out / "bf16-ppo" / "seed4" / START).write_text(json.dumps(
        {"sha256": hashlib.sha256(b"w0").hexdigest(), "warmstart": {"bf16_autocast": True}}))
    assert check_start(out, 4, base("same", b"w0", True)) is None
    assert check_start(out, 5, base("other_seed", b"w1", False)) is None  # seed 5: no record
    warning = check_start(out, 4, base("rounded", b"w2", True))
    assert "is not the committed arms'" in warning and hashlib.sha256(b"w2").hexdigest()[:12] in warning
    assert "bf16 matmuls native" in warning  # a record from before the emulation: native
    with pytest.raises(ConfigError, match="bf16_autocast=False.*bf16-ppo.*with True"):
        check_start(out, 4, base("fp32", b"w3", False))


def test_starts_markdown_groups_arms_by_start():
    a, b = "a" * 64, "b" * 64
    md = starts_markdown({0: {a: ["bf16-ppo", "int8-tis"], None: ["int8-naive"]}, 1: {b: ["bf16-ppo"]}})
    assert "- seed 0: `aaaaaaaaaaaa` bf16-ppo, int8-tis; not recorded: int8-naive" in md
    assert "- seed 1: `bbbbbbbbbbbb` bf16-ppo" in md
    assert starts_markdown({0: {None: ["bf16-ppo"]}}) == ""  # nothing recorded: no section


def _checkout(tmp_path: Path, cli_source: str) -> Path:
    """A stand-in qurl checkout whose `qurl/cli.py` is cli_source."""
    pinned = tmp_path / "pinned"
    (pinned / "qurl").mkdir(parents=True)
    (pinned / "qurl" / "__init__.py").write_text("")
    (pinned / "qurl" / "cli.py").write_text(cli_source)
    return pinned


def test_train_command_imports_the_pinned_checkout(tmp_path, monkeypatch):
    """`--train-code DIR`: the arm's process imports qurl from DIR, even run from another
    checkout's root (where `python -m` would otherwise put that checkout's qurl first)."""
    pinned = _checkout(tmp_path, "import sys; print('pinned', sys.argv[1:])\n")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # this checkout's root holds qurl/
    cmd, env = train_command(["--resume", "r"], pinned)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "pinned ['train', '--resume', 'r']"
    cmd, env = train_command(["--help"], None)  # default: this qurl
    assert "pinned" not in subprocess.run(cmd, env=env, capture_output=True, text=True).stdout
    with pytest.raises(FileNotFoundError, match="not a qurl checkout"):
        train_command([], tmp_path)


def test_an_arm_does_not_inherit_the_launchers_rendezvous(tmp_path, monkeypatch):
    """Launched from inside a torchrun world (or a shell exporting MASTER_PORT), an arm must not
    join it as a rank nor listen on its port: the arm's process sees none of those variables, and
    keeps the rest of the environment."""
    pinned = _checkout(tmp_path, "import json, os; print(json.dumps({k: os.environ.get(k) for k in "
                       "('MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
                       "'QURL_KEEP', 'HF_HUB_OFFLINE')}))\n")
    for k, v in {"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500", "RANK": "1",
                 "WORLD_SIZE": "2", "LOCAL_RANK": "1", "QURL_KEEP": "yes"}.items():
        monkeypatch.setenv(k, v)
    cmd, env = train_command([], pinned)
    seen = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True,
                                     check=True).stdout)
    assert seen == {"MASTER_ADDR": None, "MASTER_PORT": None, "RANK": None, "WORLD_SIZE": None,
                    "LOCAL_RANK": None, "QURL_KEEP": "yes", "HF_HUB_OFFLINE": "1"}

    # the study's final evaluation of an arm is such a process too
    from qurl.research.studies import final_eval

    run_dir = tmp_path / "runs" / "arm"
    (run_dir / "ckpt" / "step_3").mkdir(parents=True)
    envs = []
    monkeypatch.setattr(final_eval.subprocess, "call",
                        lambda cmd, **kw: envs.append(kw["env"]) or 1)  # exit 1: no record
    with pytest.raises(RuntimeError, match="final evaluation of"):
        final_eval.evaluate(run_dir, tmp_path / "arm", k=2, steps=3)
    assert [{k: e.get(k) for k in seen} for e in envs] == [seen]


def _strip(rec: dict) -> dict:
    """A record without its timings and wall-clock rates (which differ between any two runs)."""
    return {k: v for k, v in rec.items() if not any(t in k for t in TIMING)}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # seven qurl processes: ~590 s on 2 cores under heavy load
def test_study_spans_sessions(tmp_path, runs_dir, capsys):
    """Three 2-step `qurl train` processes: bf16 (session 1), int8-mis (session 2), the resume."""
    cfg = tiny_cfg(tmp_path, "unused", 2, **{"deploy.torch_threads": 1, "eval.samples": 2,
                                             "run.eval_every": 2})
    out, runs = tmp_path / "study", tmp_path / "runs"
    (runs / "seed0").mkdir(parents=True)  # the session's shared cache of warm-started base models
    (runs / "seed0" / "_base").symlink_to(runs_dir("study-base") / "_base", target_is_directory=True)

    ablation(cfg, out, seeds=[0], arms=["bf16-ppo"], runs_dir=runs)
    assert sorted(p.name for p in arm_dir(out, "bf16-ppo", 0).iterdir()) == sorted((*FILES, START))
    first = (arm_dir(out, "bf16-ppo", 0) / "metrics.jsonl").read_text()
    assert (out / "ablation_step.png").stat().st_size > 0

    # a new session: the run directories are gone, only the committed files remain
    shutil.rmtree(runs / "seed0" / "bf16-ppo")
    md = ablation(cfg, out, seeds=[0], arms=["int8-mis"], runs_dir=runs).read_text()
    assert not (runs / "seed0" / "bf16-ppo").exists()  # committed: not run again
    assert (arm_dir(out, "bf16-ppo", 0) / "metrics.jsonl").read_text() == first
    assert sorted(p.name for p in arm_dir(out, "int8-mis", 0).iterdir()) == sorted((*FILES, START))
    # both arms started from the seed's one cached warm start, and the table says so
    (sha, arms), = starts(out)[0].items()
    assert arms == ["bf16-ppo", "int8-mis"] and sha == start_record(runs / "seed0" / "int8-mis")["sha256"]
    assert f"- seed 0: `{sha[:12]}` bf16-ppo, int8-mis" in md
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

    # another setting is refused in one line naming the field, nothing overwritten: more steps
    # under a cosine schedule (whose decay depends on run.steps) cannot extend the 2-step arms
    with pytest.raises(ConfigError, match=r"run\.steps: 2 there, 3 here"):
        ablation(override(cfg, {"run.steps": 3, "optim.schedule": "cosine"}), out, seeds=[0],
                 arms=["bf16-ppo"], runs_dir=runs)
    # more steps at a constant rate would extend them, but only all the arms at once
    with pytest.raises(ConfigError, match=r"int8-mis/seed0: committed at 2 steps"):
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
    _assert_same_records(resumed[2:], whole[2:])

    # the study lengthened to 3 steps: int8-mis (run directory there, 2 steps finished) is
    # continued from its step-2 checkpoint, bf16 (directory gone) starts over; the extended arm's
    # records equal those of a 3-step int8-mis run made from scratch
    cfg3 = override(cfg, {"run.steps": 3})
    md3 = ablation(cfg3, out, seeds=[0], arms=["bf16-ppo", "int8-mis"], runs_dir=runs).read_text()
    said = capsys.readouterr().out
    assert "seed 0 int8-mis: committed at 2 steps, extending to 3" in said
    assert "seed 0 int8-mis: extended, finished and committed" in said
    assert "seed 0 bf16-ppo: started, finished and committed" in said
    assert "| bf16-ppo | 1 | 3 |" in md3 and "| int8-mis | 1 | 3 |" in md3
    extended = read_metrics(arm_dir(out, "int8-mis", 0) / "metrics.jsonl")
    assert extended[1]["marker"] == 1  # steps 1-2 kept, not rerun
    direct = arm_configs(cfg3, runs_dir("study-direct"), ["int8-mis"])["int8-mis"]
    assert run_to_end(direct) == "started"
    whole3 = read_metrics(runs_dir_of(direct) / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in extended] == [(r["kind"], r["step"]) for r in whole3]
    _assert_same_records(extended[2:], whole3[2:])


def runs_dir_of(cfg) -> Path:
    return Path(cfg.deploy.dir) / cfg.run.name


def _assert_same_records(got: list[dict], want: list[dict]) -> None:
    """Records equal but for timings, floats to the tolerance of two runs of one computation."""
    for a, b in zip(got, want, strict=True):
        a, b = _strip(a), _strip(b)
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(b[k], float):
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
            else:
                assert a[k] == b[k], (a["step"], k)
