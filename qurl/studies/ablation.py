"""`qurl study ablation`: the paper's ablation at CPU scale — which 8-bit rollout recipe keeps RL
training as good as a full-precision rollout.

Arms (every other config field is the caller's, so all arms share data, model, seeds and steps):

    bf16-ppo           full-precision rollout, PPO ratio, UAQ off     (the baseline)
    <q>-naive          8-bit rollout, PPO ratio over the 8-bit engine's logprobs, UAQ off
    <q>-tis            8-bit rollout, decoupled PPO with truncated IS weight min(ρ, C), UAQ off
    <q>-acr            8-bit rollout, TIS + Adaptive Clipping Range, UAQ off
    <q>-acr-uaq        8-bit rollout, ACR + update-aware scaling s (the config's, 1.5 if it is 1)

for q in int8 and fp8 (W8A8 per channel), and, only when asked for (`--arms w4a16`), w4a16: the
declared stress setting, 4-bit weight-only group-wise rollout (qurl.quant.int4). ρ = π_prox/π_behav
is the importance ratio between the learner's recomputed pre-update policy and the engine that
sampled; C = algo.tis_cap.

Each (seed, arm) runs as its own `qurl train` process through `qurl.studies.compare.run_arm`
under `<out>/seed<S>/<arm>/`; a finished arm with the same config is reused, so an interrupted
study continues where it stopped. `--jobs N` runs N arms at once (give each a thread:
`--set deploy.torch_threads=1`); the base model of each seed is built once, by its first arm.

What it writes into `<out>/` (see qurl/studies/tables.py for the exact definitions):
`ablation.md` / `ablation.csv` (one row per arm over seeds), `ablation_seeds.csv` (one row per
seed and arm), `ablation_pairs.md` (paired differences: naive vs bf16, tis vs acr, acr vs acr+UAQ)
and `ablation_step.png` (reward, accuracy and KL(behav‖prox) against step, mean over seeds).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from qurl.config import LOCAL_BASES, Config, override
from qurl.metrics import read_metrics

BASELINE = "bf16-ppo"
_QUANT_ARMS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("naive", {"algo.loss": "naive", "algo.uaq_scale": 1.0}),
    ("tis", {"algo.loss": "tis", "algo.uaq_scale": 1.0}),
    ("acr", {"algo.loss": "acr", "algo.uaq_scale": 1.0}),
    ("acr-uaq", {"algo.loss": "acr"}),  # uaq_scale: the config's (1.5 if it is 1)
)
QUANT_FORMATS = ("int8", "fp8", "w4a16")
ARMS: tuple[tuple[str, dict[str, Any]], ...] = (
    (BASELINE, {"rollout.precision": "bf16", "algo.loss": "ppo", "algo.uaq_scale": 1.0}),
    *((f"{q}-{name}", {"rollout.precision": q, **sets}) for q in QUANT_FORMATS
      for name, sets in _QUANT_ARMS),
)
ARM_NAMES: tuple[str, ...] = tuple(name for name, _ in ARMS)
# the default study: the paper's 8-bit formats; int4 (weight-only, qurl.quant.int4) is the declared
# stress setting, run only when asked for (--arms w4a16 or its arm names)
DEFAULT_ARMS: tuple[str, ...] = tuple(n for n in ARM_NAMES if not n.startswith("w4a16-"))


def select_arms(spec: str | None) -> list[str]:
    """Arm names from a comma list (ARMS order); `int8`/`fp8`/`w4a16` stand for their four arms.
    Empty/None: DEFAULT_ARMS. Unknown names are a ValueError naming them."""
    if not spec:
        return list(DEFAULT_ARMS)
    wanted: set[str] = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        group = [n for n in ARM_NAMES if n.startswith(part + "-")] if part in QUANT_FORMATS else []
        if group:
            wanted.update(group)
        elif part in ARM_NAMES:
            wanted.add(part)
        else:
            raise ValueError(f"ablation arm {part!r}: unknown (known: {', '.join(ARM_NAMES)}, "
                             "or int8 / fp8 / w4a16 for their four arms)")
    return [n for n in ARM_NAMES if n in wanted]


def arm_configs(cfg: Config, out_dir: Path, arms: list[str]) -> dict[str, Config]:
    """The config of each named arm at cfg's seed, running under out_dir/<arm>/."""
    uaq = cfg.algo.uaq_scale if cfg.algo.uaq_scale != 1.0 else 1.5
    sets_of = dict(ARMS)
    out = {}
    for name in arms:
        sets = {"algo.uaq_scale": uaq, **sets_of[name]}
        out[name] = override(cfg, {**sets, "deploy.rollout": "inline", "deploy.dir": str(out_dir),
                                   "run.name": name, "deploy.progress": False})
    return out


def run_study(cfg: Config, out_dir: str | Path, *, seeds: list[int], arms: list[str],
              jobs: int = 1) -> dict[int, dict[str, list[dict]]]:
    """Run (or reuse) every (seed, arm); returns {seed: {arm: metrics records}}."""
    from qurl.studies.compare import run_arm
    from qurl.models.base import build_base

    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError(f"ablation seeds {seeds}: give each seed once")
    if jobs < 1:
        raise ValueError(f"ablation --jobs {jobs}: must be >= 1")
    out = Path(out_dir)
    todo: list[Config] = []
    for s in seeds:
        seed_cfgs = arm_configs(override(cfg, {"run.seed": s}), out / f"seed{s}", arms)
        todo.extend(seed_cfgs.values())

    # one warm start per seed, built by the first of its arms to start (the others wait for it)
    base_locks = {c.deploy.dir: threading.Lock() for c in todo}

    def one(arm_cfg: Config) -> None:
        if cfg.model.base in LOCAL_BASES:
            with base_locks[arm_cfg.deploy.dir]:
                build_base(arm_cfg)
        print(f"[ablation] seed {arm_cfg.run.seed} {arm_cfg.run.name}: {arm_cfg.run.steps} steps",
              flush=True)
        run_arm(arm_cfg, Path(arm_cfg.deploy.dir))
        print(f"[ablation] seed {arm_cfg.run.seed} {arm_cfg.run.name}: done", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for fut in [pool.submit(one, c) for c in todo]:
            fut.result()
    return {s: {a: read_metrics(out / f"seed{s}" / a / "metrics.jsonl") for a in arms}
            for s in seeds}


def ablation(cfg: Config, out_dir: str | Path, *, seeds: list[int], arms: list[str] | None = None,
             jobs: int = 1) -> Path:
    """Run the study and write its tables and plot into out_dir; returns ablation.md."""
    from qurl.studies.plots import plot_study
    from qurl.studies.tables import write_tables

    out = Path(out_dir)
    records = run_study(cfg, out, seeds=seeds, arms=arms or list(DEFAULT_ARMS), jobs=jobs)
    path = write_tables(records, out, baseline=BASELINE)
    plot_study(records, out / "ablation_step.png")
    print(path.read_text(), flush=True)
    return path
