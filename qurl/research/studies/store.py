"""A study's committed results: each finished arm's resolved config and metrics, small enough for git.

A study over real models takes longer than a session, so its results live in the repository, not in
the run directories (which hold base models and checkpoints, gigabytes that are never committed):

    <out>/<arm>/seed<S>/config.toml     the run's resolved config, as the run wrote it
    <out>/<arm>/seed<S>/metrics.jsonl   its metrics, one JSON record per step and per evaluation
    <out>/<arm>/seed<S>/final_eval.json its last checkpoint scored again, with less noise (optional,
                                        qurl/research/studies/final_eval.py)
    <out>/<arm>/seed<S>/base.json       the weights it started from, where the run built them
                                        (`start_record`); absent for a checkpoint used as given

`<out>` also holds the tables and the plot, rebuilt from these files alone, so a later session
(or `qurl study ablation --table-only`) reproduces them without any run directory. A finished
study's records are packed into one archive beside its pages, `<out>.tar.xz` (`qurl study pack`),
and read from there as if loose: every reader here opens them through
qurl.research.studies.records.open_records (qurl/research/studies/records.py).

**Finished** (`finished`): the metrics hold one train record for every step 1..run.steps, in order,
and end with the evaluation record at step run.steps, the last thing a run writes. Anything else
(no file, a crash mid-run, a run cut by a session's end) is unfinished: it is never copied here,
and a copy found here unfinished (e.g. edited by hand) is treated as missing and run again.

**Same start** (`start_record`, `starts`): the arms of one seed are meant to start from the same
warm-started weights, and on one machine they do (the warm start is built once per seed and cached).
Across machines it need not be bitwise the same: seed 0's warm start rebuilt on another VM scored
a question or two differently at step 0 (docs/study/smollm2_regime.md, session 18; the likely
cause, not checked, is bf16 matmul kernels that round differently on other CPU instruction sets).
Each committed arm therefore records a SHA-256 of its starting weights and the warm start's
losses, and the tables say which arms of a seed share a start. Before the bf16 emulation
(qurl/models/bf16_emulated.py) a CPU without native bf16 matmul warm-started in fp32: another model
altogether (SmolLM2 seed 4: 88.2 Avg@4 at step 0 against 47.1, session 35), so `check_start`
refuses to train an arm from such a start beside arms warm-started in bf16, before its first step.

**Same study** (`check_same`): every committed arm must have been run with the training config the
study would give it now (qurl.config.tree's training sections; where it ran, `deploy`, may differ).
A committed arm from another setting (another eval size, another learning rate) is refused with one
line that names the field, rather than mixed into a table or overwritten: use another `<out>` for it.

**Extending** (`extends`): one difference is allowed, more steps, when a longer run's first steps
are exactly the shorter run's. That holds when nothing before step N depends on the run's length:
the learning rate is constant after its warmup (a cosine schedule decays over run.steps), rollout
is synchronous (rollout.max_staleness = 0: an asynchronous run near its end generates less ahead
than a longer run would at the same step), and the shorter run ended on an evaluation step (N a
multiple of run.eval_every > 0; with no periodic evaluation the shorter run's final one at N is a
record the longer run lacks), so both runs hold the same records up to N. Then `qurl train
--resume <run> --set run.steps=M` continues the finished N-step run from its step-N checkpoint
into the run an M-step study would have made, and the committed N-step arm is redone that way
instead of being refused (qurl/research/studies/runner.py). A study whose N steps end mid-transition can so
be lengthened without rerunning a step.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from qurl.config import TRAINING_SECTIONS, Config, ConfigError, leaves, override
from qurl.research.studies.records import open_records
from qurl.train.metrics_log import read_metrics

FILES = ("config.toml", "metrics.jsonl")
START = "base.json"
_ARM_FILE = re.compile(r"([^/]+)/seed(\d+)/([^/]+)")  # <arm>/seed<S>/<file>, a record's name


def arm_dir(out: Path, arm: str, seed: int) -> Path:
    """Where the committed files of (arm, seed) live: <out>/<arm>/seed<S>/."""
    return Path(out) / arm / f"seed{seed}"


def finished(records: list[dict[str, Any]], steps: int) -> bool:
    """Whether metrics records are a whole run of `steps` steps (module docstring)."""
    train = [r.get("step") for r in records if r.get("kind") == "train"]
    last = records[-1] if records else {}
    return train == list(range(1, steps + 1)) and last.get("kind") == "eval" \
        and last.get("step") == steps


def read_run(run_dir: Path) -> tuple[Config, list[dict[str, Any]]] | None:
    """(config, records) of a run or committed directory if it holds a finished run, else None.
    A committed directory may be packed into its study's archive (qurl/research/studies/records.py)."""
    from qurl.checkpoint.rundir import read_config

    rec = open_records(run_dir)
    if not all(rec.exists(f) for f in FILES):
        return None
    with rec.on_disk(*FILES) as where:
        cfg = read_config(where)
        records = read_metrics(where / "metrics.jsonl")
    return (cfg, records) if finished(records, cfg.run.steps) else None


def training_diff(a: Config, b: Config) -> str | None:
    """The first training-section field where a and b differ, as 'section.field: a vs b', or None."""
    for section in TRAINING_SECTIONS:
        pairs = zip(leaves(getattr(a, section), f"{section}."), leaves(getattr(b, section)))
        for (name, _, _, va), (_, _, _, vb) in pairs:
            if va != vb:
                return f"{name}: {va!r} vs {vb!r}"
    return None


def extends(shorter: Config, longer: Config) -> bool:
    """Whether `longer` is `shorter` run for more steps, with the same first steps (module docstring)."""
    every = longer.run.eval_every
    if shorter.run.steps >= longer.run.steps or longer.optim.schedule != "constant" \
            or longer.rollout.max_staleness != 0 or not every or shorter.run.steps % every:
        return False
    return training_diff(override(shorter, {"run.steps": longer.run.steps}), longer) is None


def check_same(where: Path, committed: Config, wanted: Config) -> None:
    """ConfigError naming the field if a committed arm's training config is not the one wanted."""
    diff = training_diff(committed, wanted)
    if diff is not None:
        raise ConfigError(f"{where}: committed with another config ({diff.replace(' vs ', ' there, ')}"
                          " here); use another --out, or remove that directory to run it again")


def start_record(run_dir: Path) -> dict[str, Any] | None:
    """The weights a run started from, when it built them (its `base_model/`, qurl.models.base):
    `base_record` of that directory, or None for a run that read a checkpoint as given."""
    return base_record(Path(run_dir) / "base_model")


def base_record(base: Path) -> dict[str, Any] | None:
    """{"sha256": over base's *.safetensors files in name order, "warmstart": the warm start's
    record (steps, lr, bf16_autocast, per-step losses) or None}; None where base holds no weights."""
    weights = sorted(Path(base).glob("*.safetensors"))
    if not weights:
        return None
    h = hashlib.sha256()
    for f in weights:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    ws = Path(base) / "warmstart.json"
    return {"sha256": h.hexdigest(), "warmstart": json.loads(ws.read_text()) if ws.exists() else None}


def check_start(out: Path, seed: int, base: Path) -> str | None:
    """Before an arm of `seed` trains from the warm start `base`: a ConfigError if its committed
    arms were warm-started at another precision (warmstart.json's bf16_autocast; qurl before the
    bf16 emulation warm-started in fp32 on a CPU without native bf16 matmul), whose weights are another
    model (SmolLM2 seed 4: 88.2 vs 47.1 Avg@4 at step 0, docs/study/smollm2_regime.md), so the
    new arm could not be paired with them. Another SHA-256 at the same precision (another CPU's
    kernels rounding differently) is allowed, as the tables already flag it: returned as a warning.
    None where the start matches, or no committed arm of the seed recorded one."""
    here = base_record(base)
    rec = open_records(out)
    there = [(m.group(1), json.loads(rec.read_text(name))) for name in rec.names()
             if (m := _ARM_FILE.fullmatch(name)) and m.group(2) == str(seed) and m.group(3) == START]
    if here is None or not there or any(r["sha256"] == here["sha256"] for _, r in there):
        return None

    def bf16(record: dict[str, Any]) -> Any:
        return (record.get("warmstart") or {}).get("bf16_autocast")

    arm, record = there[0]
    if bf16(record) != bf16(here):
        raise ConfigError(
            f"seed {seed}: the warm start built here ({base}) ran with bf16_autocast="
            f"{bf16(here)}, the seed's committed arms' ({arm}, in {out}) with {bf16(record)}: "
            "another start, so an arm trained from it could not be paired with them. Run this seed "
            "on a CPU like theirs (native bf16 matmul: AVX512-BF16 or AMX), or use another --out")
    matmul = (here.get("warmstart") or {}).get("bf16_matmul") or "native"
    return (f"seed {seed}: the warm start built here (sha256 {here['sha256'][:12]}, bf16 matmuls "
            f"{matmul}) is not the committed arms' ({record['sha256'][:12]}, {arm}), at the same "
            "precision: the table will list it as another start")


def _write(dest: Path, name: str, text: str) -> None:
    tmp = dest / f".{name}.tmp"
    tmp.write_text(text)
    tmp.replace(dest / name)


def commit(run_dir: Path, dest: Path) -> None:
    """Copy the committable files of a finished run into dest (replacing what was there), with its
    start record (START) where it built its base."""
    if read_run(run_dir) is None:
        raise ValueError(f"{run_dir}: not a finished run; nothing to commit")
    dest.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        _write(dest, name, (Path(run_dir) / name).read_text())
    start = start_record(run_dir)
    if start is not None:
        _write(dest, START, json.dumps(start, indent=1) + "\n")


def _seed_dirs(out: Path) -> list[tuple[str, int, set[str]]]:
    """[(arm, seed, {file names})] of every <arm>/seed<S>/ under out holding files, loose or packed
    (qurl/research/studies/records.py), in path order as a glob of out's directories would list them."""
    found: dict[tuple[str, str], set[str]] = {}
    for name in open_records(out).names():
        m = _ARM_FILE.fullmatch(name)
        if m:
            found.setdefault((m.group(1), m.group(2)), set()).add(m.group(3))
    return [(arm, int(seed), files) for (arm, seed), files in
            sorted(found.items(), key=lambda kv: (kv[0][0], f"seed{kv[0][1]}"))]


def starts(out: Path) -> dict[int, dict[str | None, list[str]]]:
    """{seed: {sha256 of the starting weights (None: not recorded): [arms]}} over out's committed
    arms (finished or not), arms in name order."""
    rec = open_records(out)
    found: dict[int, dict[str | None, list[str]]] = {}
    for arm, seed, files in _seed_dirs(out):
        if not all(f in files for f in FILES):
            continue
        sha = json.loads(rec.read_text(f"{arm}/seed{seed}/{START}"))["sha256"] \
            if START in files else None
        found.setdefault(seed, {}).setdefault(sha, []).append(arm)
    return found


def committed(out: Path) -> dict[tuple[str, int], tuple[Config, list[dict[str, Any]]]]:
    """Every finished (arm, seed) under out, loose or packed in its archive: {(arm, seed): (config,
    records)}. An arm's final evaluation (qurl/research/studies/final_eval.py), when committed for its last
    step, is its last record: {"kind": "final_eval", "step": N, "k": K, eval/... keys, "n": ...}."""
    found = {}
    for arm, seed, _ in _seed_dirs(out):
        seed_dir = arm_dir(out, arm, seed)
        run = read_run(seed_dir)
        if run is not None:
            final = read_final(seed_dir)
            if final is not None and final["step"] == run[0].run.steps:
                run[1].append({**final["record"], "kind": "final_eval", "k": final["k"]})
            found[(arm, seed)] = run
    return found


FINAL = "final_eval.json"
"""An arm's final evaluation record (qurl/research/studies/final_eval.py), beside its metrics."""


def read_final(arm_dir: Path, k: int | None = None, step: int | None = None) -> dict[str, Any] | None:
    """The committed final evaluation of an arm (at k samples, of the step-`step` checkpoint, where
    given), else None: an arm extended to more steps keeps its shorter run's until scored again.
    The arm may be packed in its study's archive (qurl/research/studies/records.py)."""
    rec = open_records(arm_dir)
    if not rec.exists(FINAL):
        return None
    got = json.loads(rec.read_text(FINAL))
    return got if k in (None, got.get("k")) and step in (None, got.get("step")) else None
