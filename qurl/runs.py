"""Run directories and atomic checkpoints: everything needed to resume a run exactly.

    runs/<run>/
      config.toml          resolved config (read back on resume; immutable fields checked)
      metrics.jsonl        one JSON object per step / eval
      base_model/          the HF checkpoint RL starts from (warm-started tiny model, or a copy link)
      ckpt/step_000010/    one checkpoint: learner shards, state.pt (step, version, data cursor,
                           RNG states, UAQ scale, pending trajectories, prompts in flight)
      ckpt/latest          name of the newest complete checkpoint

A checkpoint is written to `ckpt/.tmp-step_N/` and renamed into place only once complete, then
`latest` is replaced atomically (write temp file + os.replace). A crash mid-write leaves the
previous checkpoint and pointer intact; leftover temp dirs are removed on the next save.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qurl.config import Config, ConfigError, from_toml, immutable_changes, to_toml, validate


def run_dir_for(cfg: Config) -> Path:
    return Path(cfg.run.dir) / cfg.run.name


def write_config(run_dir: Path, cfg: Config) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / "config.toml", to_toml(cfg))


def read_config(run_dir: Path) -> Config:
    path = run_dir / "config.toml"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no config.toml — is {run_dir} a qurl run directory?")
    return validate(from_toml(Config(), path))


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

    def commit(self, tmp: Path) -> Path:
        final = self.root / tmp.name.removeprefix(".tmp-")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(self.root / "latest", final.name)
        ckpts = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in ckpts[:-self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / "state.pt").exists():
            raise FileNotFoundError(f"{path}: checkpoint named by {pointer} is incomplete")
        return path
