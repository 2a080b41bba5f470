"""Run directories and atomic checkpoints: everything needed to resume a run exactly.

    runs/<run>/
      config.toml          resolved config (read back on resume; immutable fields checked)
      metrics.jsonl        one JSON object per step / eval
      base_model/          the HF checkpoint RL starts from (warm-started tiny model, or a copy link)
      ckpt/step_000010/    one checkpoint: learner shards (model_rank<tp>.pt), optimizer state
                           (optim_rank<tp>[_dp<dp>].pt), state.pt (step, version, data cursor,
                           RNG states, pending trajectories, prompts in flight), manifest.json
                           (size and BLAKE3 checksum of each of those files: checksums.py)
      ckpt/latest          name of the newest complete checkpoint

A checkpoint is written to `ckpt/.tmp-step_N/`, gets its manifest, and is renamed into place only
once complete, then `latest` is replaced atomically (write temp file + os.replace). A crash
mid-write leaves the previous checkpoint and pointer intact; leftover temp dirs are removed on the
next save.

Resuming takes the newest *intact* checkpoint: every `step_*` directory is checked against its
manifest, newest first; a damaged one (truncated, bytes changed, a file missing) is skipped with a
warning naming the damaged file, and when none is intact `latest()` refuses with one line
(CheckpointError). A checkpoint without manifest.json was written before qurl recorded checksums:
it is used as it is (state.pt must exist), with a warning that it was not verified.
"""
from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qurl.checkpoint.checksums import FileSum, damage, has_manifest, write_manifest
from qurl.config import (Config, ConfigError, DeployConfig, RunConfig, immutable_changes, override,
                         toml_updates, validate)
from qurl.errors import CheckpointError

log = logging.getLogger("qurl.checkpoint.rundir")


def run_dir_for(deploy: DeployConfig, run: RunConfig) -> Path:
    """The run's directory: `<deploy.dir>/<run.name>`."""
    return Path(deploy.dir) / run.name


def write_config(run_dir: Path, toml: str) -> None:
    """Write the resolved config, as TOML text (`qurl.config.to_toml`), to run_dir/config.toml."""
    run_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / "config.toml", toml)


def read_config(run_dir: Path) -> Config:
    path = run_dir / "config.toml"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no config.toml — is {run_dir} a qurl run directory?")
    return validate(override(Config(), toml_updates(path, old_names=True)))  # also pre-redesign files


def check_resume_config(old: Config, new: Config) -> None:
    changes = immutable_changes(old, new)
    if changes:
        raise ConfigError("cannot resume with changed immutable fields: " + "; ".join(changes))


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class CheckpointDir:
    """Atomic, rotating checkpoints under `<run>/ckpt/`."""

    def __init__(self, run_dir: Path, keep: int = 2) -> None:
        self.root = Path(run_dir) / "ckpt"
        self.keep = keep

    def begin(self, step: int) -> Path:
        """A fresh temp dir to write checkpoint `step` into."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".tmp-step_{step:06d}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, sums: dict[str, FileSum] | None = None) -> Path:
        """Write tmp's manifest (`sums`: checksums taken while writing; other files are hashed
        now), rename tmp into place, point `latest` at it and drop checkpoints beyond `keep`."""
        write_manifest(tmp, sums or {})
        final = self.root / tmp.name.removeprefix(".tmp-")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(self.root / "latest", final.name)
        ckpts = self.checkpoints()
        for old in ckpts[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint dirs, oldest first (by step number)."""
        found = [p for p in self.root.glob("step_*") if p.is_dir()] if self.root.is_dir() else []
        return sorted(found, key=lambda p: (len(p.name), p.name))

    def at(self, step: int) -> Path:
        """The checkpoint of `step`, checked against its manifest; CheckpointError naming the steps
        there are when it is absent or damaged."""
        path = self.root / f"step_{step:06d}"
        if not path.is_dir():
            have = [p.name.removeprefix("step_").lstrip("0") or "0" for p in self.checkpoints()]
            raise CheckpointError(f"{self.root}: no checkpoint of step {step} (there are: "
                                  f"{', '.join(have) or 'none'})")
        problem = damage(path) if has_manifest(path) else None
        if problem is not None:
            raise CheckpointError(f"{path}: damaged: {problem}")
        return path

    def latest(self) -> Path | None:
        """The newest intact checkpoint, None if none was ever committed. Damaged ones are skipped
        with a warning naming the damaged file; CheckpointError (one line naming each damaged
        file) if none is intact."""
        problems: list[str] = []
        for path in reversed(self.checkpoints()):
            if has_manifest(path):
                problem = damage(path)
            else:  # written before checksums: only the file every checkpoint has can be checked
                problem = None if (path / "state.pt").is_file() else f"{path / 'state.pt'}: missing"
            if problem is not None:
                problems.append(problem)
                continue
            for problem in problems:
                log.warning("qurl: skipped a damaged checkpoint: %s", problem)
            if not has_manifest(path):
                log.warning("qurl: checkpoint %s has no manifest.json (written before qurl "
                            "recorded checksums): resuming from it unverified", path)
            return path
        if problems:
            raise CheckpointError(f"{self.root}: no intact checkpoint to resume from: "
                                  + "; ".join(problems))
        return None
