"""`qurl report`: a run's metrics.jsonl as one PNG of plots.

    qurl report runs/<run> [--out FILE.png]

qurl/train/plots.py draws the panels (reward and held-out accuracy, the mismatch KL, entropy,
clipping, flip fractions) into `--out`, by default runs/<run>/report.png; the command prints that
path. A run without metrics is one line, exit 2.
"""
from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    """`qurl report` with its parsed arguments (module docstring); the exit code."""
    from qurl.train.plots import report

    print(report(args.run_dir, args.out))
    return 0
