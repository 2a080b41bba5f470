"""`qurl export`: a run's trained policy out as a checkpoint that transformers and SGLang load.

    qurl export runs/<run> --out DIR [--step N] [--format hf|int8|fp8|fp8_block]
                [--dtype bfloat16|float16|float32]

The flags are checked first (one line, exit 2, for an unknown format or dtype, or a run without
a checkpoint); the checkpoint is the run's latest or `--step`'s. `--dtype` defaults to the base
checkpoint's dtype (float32 when it names none), and to bf16 for an 8-bit format (SGLang's w8a8
kernels take bf16 / fp16 activations only). Then the run's own learner ranks start
(qurl/deploy/ranks.py) and each runs qurl/train/export.py's `write_export`, whose docstring says
what each format holds; rank 0 writes the checkpoint.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from qurl.checkpoint.rundir import CheckpointDir, read_config
from qurl.config import override
from qurl.deploy.ranks import run_ranks
from qurl.errors import InputError
from qurl.train.export import DTYPES, FORMATS, base_dir, write_export


def export_run(run_dir: Path, out: Path, *, step: int | None = None, fmt: str = "hf",
               dtype: str | None = None) -> Path:
    """Export `run_dir`'s latest checkpoint (or `step`'s) to `out` (module docstring)."""
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: must be one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    cfg = override(read_config(run_dir), {"deploy.dir": str(run_dir.parent), "run.name": run_dir.name})
    ckpt = CheckpointDir(run_dir).latest() if step is None else CheckpointDir(run_dir).at(step)
    if ckpt is None:
        raise InputError(f"{run_dir}: no checkpoint to export")
    if dtype is None:
        base = json.loads((base_dir(cfg.model, run_dir) / "config.json").read_text())
        dtype = base.get("torch_dtype") or base.get("dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    if fmt != "hf" and dtype == "float32":
        dtype = "bfloat16"  # SGLang's w8a8 kernels take bf16 / fp16 activations only
    run_ranks(write_export, cfg.learner, cfg, ckpt=str(ckpt), out=str(out), fmt=fmt, dtype=dtype)
    return out


def run(args: argparse.Namespace) -> int:
    """`qurl export` with its parsed arguments (module docstring); the exit code."""
    out = export_run(Path(args.run_dir), Path(args.out), step=args.step, fmt=args.format,
                     dtype=args.dtype)
    print(f"{args.run_dir}: exported ({args.format}) to {out}")
    return 0
