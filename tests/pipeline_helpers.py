"""Shared helpers of the async-pipeline tests: tiny configs, trained-uid reading, process checks."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from qurl.config import Config, load_config
from qurl.data.splits import load_datasets

TIMING = ("time/", "tokens_per_s", "sync/time", "wall")


def tiny_sets(run_dir: Path, name: str, steps: int, **extra) -> dict:
    """`--set` pairs of a few-second-per-step config (tiny model, 4 prompts x 4 samples,
    16 tokens, 16 train prompts)."""
    sets = {
        "deploy.dir": str(run_dir), "run.name": name, "run.steps": steps, "run.eval_every": 0,
        "deploy.ckpt_every": 1, "deploy.progress": False, "model.warmstart_steps": 40,
        # one-digit sums: a briefly warm-started model is sometimes right, so rewards, advantages,
        # gradients and code flips are non-zero and the comparisons below are not vacuous
        "data.digits": 1, "data.operands": 2, "data.train_size": 16,
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 16,
        "eval.max_new_tokens": 16, "data.eval_size": 8, "optim.lr": 1e-3,
        # an fp32 learner: on CPUs without native bf16 matmul (this project's machines) torch
        # emulates a bf16 one ~20x slower than fp32, and what these tests check (streams, syncs,
        # resumes, kills) does not depend on it; the bf16 learner has its own tests
        # (test_learner.py, test_export.py, test_bf16_emulated.py)
        "model.dtype": "float32",
    }
    sets.update(extra)
    return sets


def tiny_cfg(run_dir: Path, name: str, steps: int, **extra) -> Config:
    return load_config(sets=[f"{k}={v}" for k, v in tiny_sets(run_dir, name, steps, **extra).items()])


def fleet_of(cfg: Config, run_dir: Path, **kwargs):
    """A `Fleet` (qurl/pipeline/fleet.py) of `cfg`'s workers, handed the sections it takes, as the
    controller hands them (a random run key; model dir `run_dir`/model)."""
    import secrets

    from qurl.engines.kind import EngineKind
    from qurl.pipeline.fleet import Fleet
    from qurl.weights.settings import SyncSettings

    d = cfg.deploy
    return Fleet(run_dir, secrets.token_bytes(32), str(Path(run_dir).parent / "model"),
                 engines=d.engines, host=d.host, stream=d.stream,
                 sync=SyncSettings.of(d.sync), kind=EngineKind.of(cfg.rollout, cfg.sglang),
                 max_len=max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens), **kwargs)


def use_free_dist_port() -> None:
    """In-process runs join torch.distributed at MASTER_PORT (29500 by default): pick a free port
    instead, so concurrent test runs on one machine do not collide."""
    import torch.distributed as dist

    from qurl.learner.dist import free_port

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())


def cli_sets(cfg_sets: dict) -> list[str]:
    return [a for k, v in cfg_sets.items() for a in ("--set", f"{k}={v}")]


def trained_uids(run_dir: Path) -> list[str]:
    rows = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()
            if line.strip()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"trained.jsonl steps repeat or go back: {steps}"
    return [u for r in rows for u in r["uids"]]


def assert_each_prompt_once(cfg: Config, run_dir: Path) -> None:
    """Over the run (steps * B == dataset size), every train prompt was trained exactly once."""
    train_set, _ = load_datasets(cfg.data, cfg.run.seed)
    got = Counter(trained_uids(run_dir))
    want = Counter(ex.uid for ex in train_set)
    assert got == want, (f"missing {sorted(want - got)}, extra {sorted(got - want)}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def worker_pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted((run_dir / "workers").glob("slot*.pid"))]
