"""`qurl study ablation`: the paper's ablation at CPU scale — which 8-bit rollout recipe keeps RL
training as good as a full-precision rollout — with the field's other corrections beside it.

Arms (every other config field is the caller's, so all arms share data, model, seeds and steps):

    bf16-ppo           full-precision rollout, PPO ratio, UAQ off     (the baseline)
    bf16-ppo-uaq       the baseline with UAQ's scaling s: a control, not one of the paper's arms.
                       UAQ leaves the function unchanged but not the optimizer's steps: Adam moves
                       every weight by ~lr, so on the layers stored divided by s the step is ~s
                       times larger relative to the weight. This arm shows what that costs or
                       gains with no quantization at all.
    <q>-naive          8-bit rollout, PPO ratio over the 8-bit engine's logprobs, UAQ off
    <q>-tis            8-bit rollout, decoupled PPO with truncated IS weight min(ρ, C), UAQ off
    <q>-acr            8-bit rollout, TIS + Adaptive Clipping Range, UAQ off
    <q>-acr-uaq        8-bit rollout, ACR + update-aware scaling s (the config's, 1.5 if it is 1)
    <q>-icepop         decoupled PPO, ρ masked outside algo.correction.bounds ([0.5, 5]), UAQ off
    <q>-mis            decoupled PPO, ρ > C masked (masked IS), UAQ off
    <q>-seqtis         decoupled PPO, weight min(∏ρ, C) per sequence, UAQ off
    <q>-geomask        decoupled PPO, sequence masked if exp(mean log ρ) is outside
                       algo.correction.bounds ([0.99, 1.01]), UAQ off

for q in int8 and fp8 (W8A8 per channel) and w4a16, the declared stress setting (4-bit weight-only
group-wise rollout, qurl.quant.int4). ρ = π_prox/π_behav is the importance ratio between the
learner's recomputed pre-update policy and the engine that sampled; C = algo.correction.cap. The
corrections' equations are in qurl/algo/corrections.py. The default study is the paper's: bf16 and
the first four arms of int8 and fp8; `--arms` names arms or groups: `<q>` (its four paper arms),
`<q>-field` (its four field corrections).

Spanning sessions. The results go to `<out>/<arm>/seed<S>/{config.toml, metrics.jsonl}` (see
qurl/research/studies/store.py) as soon as an arm finishes; the run directories, with base models and
checkpoints, go to `--runs` (default <deploy.dir>/study/<name of out>; seed<S>/<arm>/ in it), never
committed. Running the study again runs only the (seed, arm) pairs not yet finished in `<out>`
(an interrupted run is resumed from its last checkpoint when its run directory is still there, see
qurl/research/studies/runner.py), then rebuilds the tables and plot from every finished arm in `<out>`,
including arms of earlier sessions that were not asked for this time. `--table-only` runs nothing.
A study can be lengthened: asked for more steps (`--set run.steps=M`), a committed shorter arm whose
first steps a longer run repeats exactly (constant learning rate, synchronous rollout: see
qurl/research/studies/store.py) is continued from its last checkpoint instead of refused.
`--jobs N` runs N arms at once (give each a thread: `--set deploy.torch_threads=1`); the base model
of each seed is built once, by its first arm.

Resolution. A final accuracy is one evaluation of one RL trajectory. Its measurement noise is the
binomial standard error sqrt(p(1−p)/n): 3.5 points at p = 0.5 over n = 200 greedy questions, 1.6
over 1000; Avg@k (`--set eval.samples=k`, the table's headline when measured) lowers it further,
toward sqrt(p(1−p)/(n·k)) when questions are of middling difficulty. The trajectory's own spread is
larger (starting accuracy ranged 27–55% over seeds in the W4A16 study), so arms are compared paired
by seed: Δ = arm − bf16 in the same seed, reported as mean ± standard error sd(Δ)/sqrt(seeds). To
resolve 2 points, raise data.eval_size (0 = the whole eval split) and eval.samples until the table's
`eval se` is well under 1 point, then add seeds until the se of Δ is under 1. Where the held-out
split is small (the real-model recipe's has ~230 questions), `--final-eval K` scores each finished
arm's last checkpoint once more with Avg@K (qurl/research/studies/final_eval.py) instead of evaluating every
eval_every steps with K samples.

What it writes into `<out>/` (see qurl/research/studies/tables.py for the exact definitions):
`ablation.md` / `ablation.csv` (one row per arm over seeds), `ablation_seeds.csv` (one row per
seed and arm), `ablation_pairs.csv` (paired differences with their standard errors) and
`ablation_step.png` (reward, accuracy and KL(behav‖prox) against step, mean over seeds). A study
packed with `qurl study pack` (its records in `<out>.tar.xz`, qurl/research/studies/records.py) is read
from its archive, and its CSVs are written back into it.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from qurl.config import Config, ConfigError, override
from qurl.research.studies.store import (arm_dir, check_same, check_start, commit, committed, extends,
                                training_diff)

BASELINE = "bf16-ppo"
_QUANT_ARMS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("naive", {"algo.loss": "naive", "algo.uaq_scale": 1.0}),
    ("tis", {"algo.loss": "tis", "algo.uaq_scale": 1.0}),
    ("acr", {"algo.loss": "acr", "algo.uaq_scale": 1.0}),
    ("acr-uaq", {"algo.loss": "acr"}),  # uaq_scale: the config's (1.5 if it is 1)
)
FIELD_CORRECTIONS = ("icepop", "mis", "seqtis", "geomask")
_FIELD_ARMS: tuple[tuple[str, dict[str, Any]], ...] = tuple(
    (name, {"algo.loss": name, "algo.uaq_scale": 1.0}) for name in FIELD_CORRECTIONS)
QUANT_FORMATS = ("int8", "fp8", "w4a16")
ARMS: tuple[tuple[str, dict[str, Any]], ...] = (
    (BASELINE, {"rollout.precision": "bf16", "algo.loss": "ppo", "algo.uaq_scale": 1.0}),
    (f"{BASELINE}-uaq", {"rollout.precision": "bf16", "algo.loss": "ppo"}),  # uaq: as acr-uaq's
    *((f"{q}-{name}", {"rollout.precision": q, **sets}) for q in QUANT_FORMATS
      for name, sets in _QUANT_ARMS + _FIELD_ARMS),
)
ARM_NAMES: tuple[str, ...] = tuple(name for name, _ in ARMS)
GROUPS: dict[str, tuple[str, ...]] = {
    **{q: tuple(f"{q}-{n}" for n, _ in _QUANT_ARMS) for q in QUANT_FORMATS},
    **{f"{q}-field": tuple(f"{q}-{n}" for n in FIELD_CORRECTIONS) for q in QUANT_FORMATS},
}
# the default study: the paper's arms at its 8-bit formats; int4 (weight-only, qurl.quant.int4) is
# the declared stress setting and the field's corrections are extra arms, run when asked for
DEFAULT_ARMS: tuple[str, ...] = (BASELINE, *GROUPS["int8"], *GROUPS["fp8"])


def select_arms(spec: str | None) -> list[str]:
    """Arm names from a comma list (ARMS order); a GROUPS name (`int8`, `int8-field`, ...) stands
    for its arms. Empty/None: DEFAULT_ARMS. Unknown names are a ValueError naming them."""
    if not spec:
        return list(DEFAULT_ARMS)
    wanted: set[str] = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part in GROUPS:
            wanted.update(GROUPS[part])
        elif part in ARM_NAMES:
            wanted.add(part)
        else:
            raise ValueError(f"ablation arm {part!r}: unknown (known: {', '.join(ARM_NAMES)}; "
                             f"groups: {', '.join(GROUPS)})")
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


def _found_records(found: dict) -> dict[int, dict[str, list[dict]]]:
    """{(arm, seed): (cfg, records)} -> {seed: {arm: records}}, seeds sorted, arms in ARMS order."""
    order = {a: i for i, a in enumerate(ARM_NAMES)}
    out: dict[int, dict[str, list[dict]]] = {}
    for arm, seed in sorted(found, key=lambda k: (k[1], order.get(k[0], len(order)), k[0])):
        out.setdefault(seed, {})[arm] = found[(arm, seed)][1]
    return out


def _check_mutually_consistent(found: dict, out: Path) -> None:
    """The committed arms differ only in what makes an arm (precision, loss, UAQ) and their seed."""
    neutral = {"rollout.precision": "bf16", "algo.loss": "ppo", "algo.uaq_scale": 1.0,
               "run.seed": 0, "run.name": "arm"}
    first = None
    for (arm, seed), (c, _) in sorted(found.items()):
        norm = override(c, neutral)
        if first is None:
            first = (arm, seed, norm)
        elif (diff := training_diff(norm, first[2])) is not None:
            raise ConfigError(f"{arm_dir(out, arm, seed)} and {arm_dir(out, first[0], first[1])}: "
                              f"committed with different configs ({diff})")


def run_study(cfg: Config, out_dir: str | Path, *, seeds: list[int], arms: list[str],
              runs_dir: str | Path | None = None, jobs: int = 1, table_only: bool = False,
              final_eval: int = 0, train_code: str | Path | None = None
              ) -> dict[int, dict[str, list[dict]]]:
    """Run every (seed, arm) not yet finished in out_dir (module docstring), commit each into
    out_dir as it finishes; with final_eval = k > 0 also give every finished arm of out_dir a final
    evaluation with Avg@k where it has none (qurl/research/studies/final_eval.py); train_code: the qurl
    checkout whose `qurl train` runs the arms (qurl/research/studies/runner.py). Returns
    {seed: {arm: records}} of every finished arm in out_dir."""
    from qurl.models.base import build_base_apart, builds_base
    from qurl.research.studies import final_eval as fe
    from qurl.research.studies.runner import run_to_end

    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError(f"ablation seeds {seeds}: give each seed once")
    if jobs < 1:
        raise ValueError(f"ablation --jobs {jobs}: must be >= 1")
    out = Path(out_dir)
    runs = Path(runs_dir) if runs_dir else Path(cfg.deploy.dir) / "study" / out.name
    found = {k: v for k, v in committed(out).items() if k[0] in ARM_NAMES}
    if table_only:
        _check_mutually_consistent(found, out)
        return _found_records(found)

    def arm_cfg(arm: str, seed: int) -> Config:
        return arm_configs(override(cfg, {"run.seed": seed}), runs / f"seed{seed}", [arm])[arm]

    for (arm, seed), (c, _) in list(found.items()):
        if extends(c, arm_cfg(arm, seed)):  # a shorter arm is continued (qurl/research/studies/store.py)
            if seed not in seeds or arm not in arms:  # else its table would mix run lengths
                raise ConfigError(f"{arm_dir(out, arm, seed)}: committed at {c.run.steps} steps; "
                                  f"to lengthen the study to {cfg.run.steps}, ask for its seed and "
                                  "arm too (--seeds, --arms), or use another --out")
            print(f"[ablation] seed {seed} {arm}: committed at {c.run.steps} steps, "
                  f"extending to {cfg.run.steps}", flush=True)
            del found[(arm, seed)]
        else:
            check_same(arm_dir(out, arm, seed), c, arm_cfg(arm, seed))
    todo = [arm_cfg(a, s) for s in seeds for a in arms if (a, s) not in found]
    for a, s in ((a, s) for s in seeds for a in arms if (a, s) in found):
        print(f"[ablation] seed {s} {a}: committed in {arm_dir(out, a, s)}", flush=True)

    def evaluate(arm: str, seed: int) -> None:
        where = arm_dir(out, arm, seed)
        if final_eval and fe.read_final(where, final_eval, step=cfg.run.steps) is None:
            how = fe.evaluate(runs / f"seed{seed}" / arm, where, final_eval, cfg.run.steps)
            print(f"[ablation] seed {seed} {arm}: final evaluation (avg@{final_eval}): {how}",
                  flush=True)

    def one(c: Config) -> None:
        if builds_base(c.model):  # one warm start per seed: its first arm builds it, the others wait
            base = build_base_apart(c.model, c.data, c.run.seed, c.deploy)
            warning = check_start(out, c.run.seed, base)
            if warning:
                print(f"[ablation] {warning}", flush=True)
        print(f"[ablation] seed {c.run.seed} {c.run.name}: {c.run.steps} steps", flush=True)
        how = run_to_end(c, Path(train_code) if train_code else None)
        commit(Path(c.deploy.dir) / c.run.name, arm_dir(out, c.run.name, c.run.seed))
        print(f"[ablation] seed {c.run.seed} {c.run.name}: {how}, finished and committed", flush=True)
        evaluate(c.run.name, c.run.seed)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for fut in [pool.submit(one, c) for c in todo]:
            fut.result()
        # arms finished earlier (other sessions, other --arms) get theirs too
        for fut in [pool.submit(evaluate, a, s) for a, s in found]:
            fut.result()
    return _found_records({k: v for k, v in committed(out).items() if k[0] in ARM_NAMES})


def ablation(cfg: Config, out_dir: str | Path, *, seeds: list[int], arms: list[str] | None = None,
             runs_dir: str | Path | None = None, jobs: int = 1, table_only: bool = False,
             final_eval: int = 0, train_code: str | Path | None = None) -> Path:
    """Run what is missing and write the tables and plot of every finished arm into out_dir;
    returns ablation.md."""
    from qurl.research.studies.plots import plot_study
    from qurl.research.studies.page import write_tables

    out = Path(out_dir)
    records = run_study(cfg, out, seeds=seeds, arms=arms or list(DEFAULT_ARMS), runs_dir=runs_dir,
                        jobs=jobs, table_only=table_only, final_eval=final_eval,
                        train_code=train_code)
    if not records:
        raise ConfigError(f"{out}: no finished arm to tabulate (qurl/research/studies/store.py)")
    path = write_tables(records, out, baseline=BASELINE)
    plot_study(records, out / "ablation_step.png")
    print(path.read_text(), flush=True)
    return path
