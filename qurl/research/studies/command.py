"""`qurl compare` and `qurl study ablation|pack|unpack`: which study a command line runs.

    qurl compare [--seeds 0,1] [--arms A,B] [--set ...] [--out runs/compare]
    qurl study ablation --seeds 0,1,2 [--arms int8] [--jobs 2] [--final-eval K] --out DIR
    qurl study pack|unpack --out DIR

The flags are parsed in qurl/cli.py, which hands them here (as `qurl bench`'s go to
qurl/research/bench/command.py): research sits behind its wall, so the product's commands (qurl/commands/)
do not reach in. `compare` runs sync vs async x bf16 vs 8-bit rollout (compare.py); `ablation` the
paper's arms over seeds (ablation.py), whose bad `--arms`, `--jobs` or `--final-eval` is one line,
exit 2; `pack` / `unpack` move a study's records into / out of <out>.tar.xz (records.py).
"""
from __future__ import annotations

import argparse

from qurl.config import ConfigError, load_config


def run_compare(args: argparse.Namespace) -> int:
    """`qurl compare` with its parsed arguments (module docstring); the exit code."""
    from qurl.research.studies.compare import compare

    arms = [a for a in args.arms.split(",") if a] if args.arms else None
    compare(load_config(args.preset, args.config, args.set), out_dir=args.out, arms=arms,
            seeds=args.seeds)
    return 0


def run_study(args: argparse.Namespace) -> int:
    """`qurl study` with its parsed arguments (module docstring); the exit code."""
    from qurl.research.studies.ablation import ablation, select_arms

    if args.what in ("pack", "unpack"):  # records <-> <out>.tar.xz: qurl/research/studies/records.py
        from qurl.research.studies.records import main_records

        return main_records([args.what, args.out])
    try:
        arms = select_arms(args.arms)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: must be >= 1")
    if args.final_eval < 0:
        raise ConfigError(f"--final-eval {args.final_eval}: samples per question, >= 1 (0 = off)")
    ablation(load_config(args.preset, args.config, args.set), args.out, seeds=args.seeds,
             arms=arms, runs_dir=args.runs, jobs=args.jobs, table_only=args.table_only,
             final_eval=args.final_eval, train_code=args.train_code)
    return 0
