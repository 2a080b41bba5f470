"""Run one study arm to its end as a `qurl train` process, resuming an interrupted one.

The run directory is `<deploy.dir>/<run.name>/` (outside the committed results: it holds the base
model and checkpoints). What happens depends on what is already there:

- a finished run (qurl.research.studies.store.finished) with the same training config: nothing to do;
- an unfinished run with the same training config and at least one checkpoint: it is resumed
  (`qurl train --resume`), which restores the learner, optimizer, data cursor and RNG state of the
  newest intact checkpoint and truncates metrics.jsonl to it, so the resumed run's records equal an
  uninterrupted run's (qurl/checkpoint/rundir.py, qurl/train/metrics_log.py). At most deploy.ckpt_every steps are redone;
- a finished shorter run that the wanted one extends (qurl.research.studies.store.extends: only more steps,
  and the same first steps): it is continued from its last checkpoint with
  `qurl train --resume <run> --set run.steps=M`;
- anything else (no checkpoint, another config): the directory is removed and the run starts over.

The process's output is appended to `<deploy.dir>/<run.name>.log`.

An arm's processes (its training here, its final evaluation in qurl/research/studies/final_eval.py) get
this process's environment, offline, less torch.distributed's rendezvous variables (`arm_env`).
An arm is a run of its own on this machine, while this process may sit inside one: launched by
torchrun, under a job script that exports MASTER_PORT, or holding a group itself. Inherited, RANK
and WORLD_SIZE would make the arm join that world as one of its ranks (qurl/commands/ranks.py), and
MASTER_PORT would make it listen on a port that the live group, or the arm running beside it
(`--jobs N`), already holds. Without them each arm picks a free port.

Which code trains. By default the `qurl` this process imports. A study that spans sessions can pin
its arms to one checkout instead (`code`, a directory holding `qurl/`, e.g. a git worktree at a
fixed commit): RL turns a float-rounding change in a later commit (a fused kernel, a reordered sum)
into a different trajectory from the first sampled step on, so arms trained by different commits
are not samples of one experiment. The study's own logic (what to run, final evaluations, tables)
stays this process's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from qurl.config import Config, to_toml
from qurl.research.studies.store import extends, read_run, training_diff


def _resumable(run_dir: Path, cfg: Config) -> bool:
    from qurl.checkpoint.rundir import read_config

    if not (run_dir / "config.toml").exists() or not any((run_dir / "ckpt").glob("step_*")):
        return False
    try:
        old = read_config(run_dir)
    except Exception:  # an unreadable config.toml: start over  # noqa: BLE001
        return False
    return training_diff(old, cfg) is None


RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                   "LOCAL_WORLD_SIZE")


def arm_env() -> dict[str, str]:
    """The environment of an arm's own process (module docstring): offline, and without
    RENDEZVOUS_VARS."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def train_command(argv: list[str], code: Path | None) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of a `qurl train <argv>` process of its own (`arm_env`), importing
    qurl from `code` if given: PYTHONPATH names it and -P keeps the working directory's qurl (a
    checkout's root) from coming first."""
    env = arm_env()
    if code is None:
        return [sys.executable, "-m", "qurl.cli", "train", *argv], env
    if not (Path(code) / "qurl" / "cli.py").is_file():
        raise FileNotFoundError(f"{code}: no qurl/cli.py there; not a qurl checkout to train with")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(code).resolve()),
                                                    env.get("PYTHONPATH")) if p)
    return [sys.executable, "-P", "-m", "qurl.cli", "train", *argv], env


def run_to_end(cfg: Config, code: Path | None = None) -> str:
    """Bring cfg's run to its end, training with the qurl in `code` if given (module docstring);
    returns what was done: 'done', 'resumed', 'extended' or 'started'."""
    root = Path(cfg.deploy.dir)
    run_dir = root / cfg.run.name
    done = read_run(run_dir) if run_dir.exists() else None
    if done is not None and training_diff(done[0], cfg) is None:
        return "done"
    root.mkdir(parents=True, exist_ok=True)
    if done is not None and extends(done[0], cfg):
        how, argv = "extended", ["--resume", str(run_dir), "--set", f"run.steps={cfg.run.steps}"]
    elif _resumable(run_dir, cfg):
        how, argv = "resumed", ["--resume", str(run_dir)]
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        toml = root / f"{cfg.run.name}.toml"
        toml.write_text(to_toml(cfg))
        how, argv = "started", ["--config", str(toml)]
    log = root / f"{cfg.run.name}.log"
    cmd, env = train_command(argv, code)
    with log.open("ab") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0 or read_run(run_dir) is None:
        raise RuntimeError(f"study arm {cfg.run.name} ({how}) did not finish (exit {rc}); see {log}")
    return how
