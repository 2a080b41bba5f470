"""`qurl compare`: sync vs async, bf16 vs 8-bit QuRL rollout — same seed, same data, same step budget.

Arms (every other config field is the caller's, so they share seed, data, model, steps, batch):

    sync-bf16            precision bf16, decoupled loss, no UAQ     (full-precision reference)
    sync-int8-acr-uaq    precision int8, ACR, UAQ (s from the config, 1.5 if it is 1)
    async1-bf16          as sync-bf16, async with max_staleness 1
    async1-int8-acr-uaq  as sync-int8-acr-uaq, async with max_staleness 1
    sync-int8-naive      precision int8, naive ratio (quantized logp as the denominator), no UAQ

Each arm runs as its own `qurl train` process (one after the other, so they do not compete for the
cores) under `<out>/<arm>/`; a finished arm is reused when compare runs again with the same config,
anything else starts over. Every arm is timed the same way, from outside: compare stamps each metrics record with
the moment it appeared (seconds since the arm's process started). Then `<out>/compare.md` and `compare.csv` get one row per arm:

- final (and initial) held-out greedy accuracy;
- steps/hour of the training loop: train steps / (wall clock from the end of the step-0 evaluation to
  the last train record, minus intermediate evaluations), so process start-up and evaluation do not
  count, and the ratio of each arm to its sync counterpart;
- the arm's whole wall time (process included);
- the torch CPU threads it ran on (`threads`: learner, or learner+workers). By default
  (deploy.torch_threads = 0, see qurl/node/placement.py) every arm gets the whole machine: the sync
  loop generates and trains on every core, an async run splits the cores between its learner and
  its workers. (One thread per process instead would leave the sync arm's other cores idle and
  flatter async.)
- mean mismatch KL(behav‖prox) over the steps, its stale-token part (`/s1`) for async arms, and the
  mean flip fraction of the 8-bit codes;
and `compare_step.png` / `compare_wall.png` plot every arm's metrics against step and wall time.

Several seeds (`--seeds 0,1,2,3`): one such compare per seed under `<out>/seed<S>/`, then
`<out>/compare_seeds.md` / `.csv` summarise each arm over the seeds — mean and standard deviation of
the final accuracy, the accuracy difference to its sync counterpart paired by seed, the same for the
training reward of the last 5 steps, steps/hour and the speedup (mean, min, max). One seed's
accuracy is a greedy score on `data.eval_size` prompts (200 by default, and the default task's
eval split has only 230: a binomial standard error of ~3.5 points near 50%) after one RL
trajectory, so a difference of a couple of points between two arms is only meaningful over seeds.
"""
from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from qurl.config import Config, override, to_toml
from qurl.research.studies.runner import train_command
from qurl.train.metrics_log import read_metrics

ARMS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("sync-bf16", {"deploy.rollout": "inline", "rollout.precision": "bf16", "algo.loss": "decoupled",
                   "algo.uaq_scale": 1.0}),
    ("sync-int8-acr-uaq", {"deploy.rollout": "inline", "rollout.precision": "int8",
                           "algo.loss": "acr"}),
    ("async1-bf16", {"deploy.rollout": "workers", "rollout.max_staleness": 1,
                     "rollout.precision": "bf16", "algo.loss": "decoupled", "algo.uaq_scale": 1.0}),
    ("async1-int8-acr-uaq", {"deploy.rollout": "workers", "rollout.max_staleness": 1,
                             "rollout.precision": "int8", "algo.loss": "acr"}),
    ("sync-int8-naive", {"deploy.rollout": "inline", "rollout.precision": "int8", "algo.loss": "naive",
                         "algo.uaq_scale": 1.0}),
)


def arm_configs(cfg: Config, out_dir: Path, arms: list[str] | None = None) -> dict[str, Config]:
    """The config of every arm (or of the named ones, in ARMS order); unknown names are errors."""
    known = [name for name, _ in ARMS]
    unknown = sorted(set(arms or ()) - set(known))
    if unknown:
        raise ValueError(f"compare arms {unknown}: unknown (known: {', '.join(known)})")
    uaq = cfg.algo.uaq_scale if cfg.algo.uaq_scale != 1.0 else 1.5
    out = {}
    for name, sets in ARMS:
        if arms and name not in arms:
            continue
        sets = dict(sets)
        sets.setdefault("algo.uaq_scale", uaq)
        out[name] = override(cfg, {**sets, "deploy.dir": str(out_dir), "run.name": name,
                                   "deploy.progress": False})
    return out


def _finished(run_dir: Path, steps: int) -> bool:
    recs = read_metrics(run_dir / "metrics.jsonl")
    return any(r.get("kind") == "eval" and r.get("step") == steps for r in recs) and \
        sum(r.get("kind") == "train" for r in recs) == steps


class _Stamper:
    """Stamps each new line of a metrics.jsonl with the wall time it appeared (s since start)."""

    def __init__(self, path: Path, t0: float) -> None:
        self.path, self.t0, self.offset = path, t0, 0
        self.stamps: dict[str, float] = {}

    def poll(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() < self.offset:  # the logger rewrote (truncated) the file
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        now = time.monotonic() - self.t0
        for line in complete.decode().splitlines():
            if line.strip():
                rec = json.loads(line)
                self.stamps.setdefault(f"{rec.get('kind')}:{rec.get('step')}", now)


def run_arm(cfg: Config, out_dir: Path) -> dict[str, Any]:
    """Run one arm as a `qurl train` process (reusing a finished one). Returns its timing:
    {"arm_wall_s": process seconds, "stamps": {"kind:step": seconds since the process started}}.

    Every arm is timed the same way, from outside: the moment each metrics record appears."""
    run_dir = out_dir / cfg.run.name
    timing_file = out_dir / f"{cfg.run.name}.timing.json"
    toml = out_dir / f"{cfg.run.name}.toml"
    same_cfg = toml.exists() and toml.read_text() == to_toml(cfg)
    if same_cfg and _finished(run_dir, cfg.run.steps) and timing_file.exists():
        return json.loads(timing_file.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished arm starts over: timings stay whole
    out_dir.mkdir(parents=True, exist_ok=True)
    toml.write_text(to_toml(cfg))
    log = out_dir / f"{cfg.run.name}.log"
    cmd, env = train_command(["--config", str(toml)], None)
    t0 = time.monotonic()
    stamper = _Stamper(run_dir / "metrics.jsonl", t0)
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            stamper.poll()
            time.sleep(0.05)
    stamper.poll()
    if proc.returncode != 0:
        raise RuntimeError(f"compare arm {cfg.run.name} failed (exit {proc.returncode}); see {log}")
    timing = {"arm_wall_s": time.monotonic() - t0, "stamps": stamper.stamps}
    timing_file.write_text(json.dumps(timing))
    return timing


def with_wall(records: list[dict], stamps: dict[str, float]) -> list[dict]:
    """Records with `wall` = when they appeared (seconds since their arm's process started)."""
    out = []
    for r in records:
        key = f"{r.get('kind')}:{r.get('step')}"
        if key not in stamps:
            raise ValueError(f"no timing stamp for record {key}")
        out.append({**r, "wall": stamps[key]})
    return out


def _mean(vals: list[float]) -> float:
    vals = [v for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def summarize(name: str, records: list[dict], arm_wall_s: float) -> dict[str, Any]:
    """One table row from an arm's records (which carry the externally stamped `wall`)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train or not evals:
        raise ValueError(f"compare arm {name}: metrics.jsonl has no train or eval records")
    start = next((r["wall"] for r in evals if r["step"] == 0), 0.0)
    mid_eval = sum(r.get("time/eval", 0.0) for r in evals if 0 < r["step"] < train[-1]["step"])
    loop_s = train[-1]["wall"] - start - mid_eval
    threads = [train[0].get(k) for k in ("threads/learner", "threads/workers")]
    return {
        "arm": name, "steps": len(train),
        "threads": "+".join(str(int(t)) for t in threads if isinstance(t, (int, float))
                            and math.isfinite(t)) or "?",
        "acc_initial": evals[0]["accuracy"], "acc_final": evals[-1]["accuracy"],
        "steps_per_hour": len(train) / loop_s * 3600 if loop_s > 0 else float("nan"),
        "loop_wall_s": loop_s, "arm_wall_s": arm_wall_s,
        "kl_mean": _mean([r.get("kl_behav_prox") for r in train]),
        "kl_stale_mean": _mean([r.get("kl_behav_prox/s1") for r in train]),
        "flip_frac_mean": _mean([r.get("flip_frac") for r in train]),
        "reward_last5": _mean([r.get("reward") for r in train[-5:]]),
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "—" if not math.isfinite(v) else (f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}")
    return str(v)


def _md_table(rows: list[dict[str, Any]], cols: list[str]) -> list[str]:
    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows])


def write_table(rows: list[dict[str, Any]], out_dir: Path) -> Path:
    by = {r["arm"]: r for r in rows}
    for r in rows:
        ref = by.get(r["arm"].replace("async1-", "sync-"))
        r["speedup_vs_sync"] = (r["steps_per_hour"] / ref["steps_per_hour"]
                                if ref is not None and ref["steps_per_hour"] > 0 else float("nan"))
    cols = ["arm", "threads", "steps", "acc_initial", "acc_final", "steps_per_hour", "speedup_vs_sync",
            "loop_wall_s", "arm_wall_s", "kl_mean", "kl_stale_mean", "flip_frac_mean",
            "reward_last5"]
    with (out_dir / "compare.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows({c: r[c] for c in cols} for r in rows)

    md = _md_table(rows, cols)
    path = out_dir / "compare.md"
    path.write_text("# qurl compare\n\nSame seed, data and step budget for every arm; "
                    "steps/hour counts the training loop only (see qurl/research/studies/compare.py).\n\n"
                    + "\n".join(md) + "\n")
    return path


def _sd(vals: list[float]) -> float:
    """Sample standard deviation (n - 1); NaN for fewer than two values."""
    vals = [v for v in vals if math.isfinite(v)]
    if len(vals) < 2:
        return float("nan")
    m = sum(vals) / len(vals)
    return math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def summarize_seeds(rows_by_seed: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per arm over the seeds, from each seed's table rows (after `write_table`, which adds
    speedup_vs_sync). `*_vs_sync` is the arm's final accuracy (mean training reward of the last 5
    steps) minus its sync counterpart's in the same seed (seeds where both ran), NaN for the sync
    arms themselves."""
    names = list(dict.fromkeys(r["arm"] for rows in rows_by_seed.values() for r in rows))
    by = {s: {r["arm"]: r for r in rows} for s, rows in rows_by_seed.items()}
    out = []
    for arm in names:
        ref = arm.replace("async1-", "sync-")
        mine = [b[arm] for b in by.values() if arm in b]
        paired = [b for b in by.values() if arm != ref and arm in b and ref in b]

        def delta(key: str) -> list[float]:
            return [b[arm][key] - b[ref][key] for b in paired]

        speed = [r["speedup_vs_sync"] for r in mine if math.isfinite(r["speedup_vs_sync"])]
        acc = [r["acc_final"] for r in mine]
        out.append({
            "arm": arm, "seeds": len(mine),
            "acc_final_mean": _mean(acc), "acc_final_sd": _sd(acc),
            "acc_vs_sync_mean": _mean(delta("acc_final")), "acc_vs_sync_sd": _sd(delta("acc_final")),
            "reward_last5_mean": _mean([r["reward_last5"] for r in mine]),
            "reward_vs_sync_mean": _mean(delta("reward_last5")),
            "steps_per_hour_mean": _mean([r["steps_per_hour"] for r in mine]),
            "speedup_mean": _mean(speed),
            "speedup_min": min(speed) if speed else float("nan"),
            "speedup_max": max(speed) if speed else float("nan"),
        })
    return out


def write_seed_table(summary: list[dict[str, Any]], rows_by_seed: dict[int, list[dict[str, Any]]],
                     out_dir: Path) -> Path:
    """compare_seeds.csv (the summary) and compare_seeds.md (summary + every seed's rows)."""
    cols = list(summary[0])
    with (out_dir / "compare_seeds.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(summary)
    per_seed = [{"seed": s, **r} for s, rows in rows_by_seed.items() for r in rows]
    md = (["# qurl compare over seeds", "",
           f"Seeds {', '.join(map(str, rows_by_seed))}; per arm: final accuracy (mean, sd), its "
           "difference to the sync arm of the same precision paired by seed (mean, sd), the mean "
           "training reward of the last 5 steps and its paired difference, steps/hour and speedup "
           "vs sync (see qurl/research/studies/compare.py).", ""]
          + _md_table(summary, cols) + ["", "## Every seed", ""]
          + _md_table(per_seed, ["seed", "arm", "threads", "acc_initial", "acc_final",
                                 "steps_per_hour", "speedup_vs_sync"]))
    path = out_dir / "compare_seeds.md"
    path.write_text("\n".join(md) + "\n")
    return path


def compare(cfg: Config, out_dir: str | Path = "runs/compare", arms: list[str] | None = None,
            seeds: list[int] | None = None) -> Path:
    """Run every arm (ARMS; or only `arms`) and write the table and plots into out_dir; with
    `seeds`, one compare per seed in out_dir/seed<S>/ and the summary over them. Returns
    compare.md (compare_seeds.md with seeds)."""
    if not seeds:
        return _compare_seed(cfg, Path(out_dir), arms)[0]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"compare seeds {seeds}: each seed once")
    out = Path(out_dir)
    rows_by_seed = {s: _compare_seed(override(cfg, {"run.seed": s}), out / f"seed{s}", arms)[1]
                    for s in seeds}
    path = write_seed_table(summarize_seeds(rows_by_seed), rows_by_seed, out)
    print(path.read_text(), flush=True)
    return path


def _compare_seed(cfg: Config, out: Path, arms: list[str] | None) -> tuple[Path, list[dict]]:
    """One compare at cfg's seed: (compare.md, its rows)."""
    from qurl.train.plots import plot_runs

    rows, runs = [], {}
    for name, arm_cfg in arm_configs(cfg, out, arms).items():
        print(f"[compare] {name}: running {arm_cfg.run.steps} steps", flush=True)
        timing = run_arm(arm_cfg, out)
        records = with_wall(read_metrics(out / name / "metrics.jsonl"), timing["stamps"])
        rows.append(summarize(name, records, timing["arm_wall_s"]))
        runs[name] = records
        r = rows[-1]
        print(f"[compare] {name}: accuracy {r['acc_initial']:.3f} -> {r['acc_final']:.3f}, "
              f"{r['steps_per_hour']:.0f} steps/h", flush=True)
    path = write_table(rows, out)
    plot_runs(runs, out / "compare_step.png", x="step")
    plot_runs(runs, out / "compare_wall.png", x="wall")
    print(path.read_text(), flush=True)
    return path, rows
