"""`qurl export`: a run's trained policy out as a checkpoint that transformers and SGLang load.

    qurl export runs/<run> --out DIR [--step N] [--format hf|int8|fp8|fp8_block]
                [--dtype bfloat16|float16|float32]

The flags are checked first (one line, exit 2, for an unknown format or dtype, or a run without
a checkpoint); the checkpoint is the run's latest or `--step`'s. `--dtype` defaults to the base
checkpoint's dtype (float32 when it names none), and to bf16 for an 8-bit format (SGLang's w8a8
kernels take bf16 / fp16 activations only). Then the run's own learner ranks start
(ranks.py), each opens the checkpoint (`qurl.train.run_setup.on_checkpoint`)
and runs `write_export`; rank 0 writes the checkpoint.

What it writes. A run's checkpoints hold the learner's Megatron shards
(`ckpt/step_N/model_rank*.pt`, optimizer files with the fp32 master weights), which only qurl
reads. Each of the run's learner ranks loads one of them into the learner exactly as `--resume`
and `qurl eval` do (the run's own TP and DP ranks, its layer spec); `write_export` streams the
fp32 master weights out under their HF names (`named_weights`, TP-gathered), and rank 0 writes:

- `--format hf` (default): a plain HF checkpoint in `--dtype` (default: the base checkpoint's
  dtype) — safetensors, config.json, tokenizer, chat template, generation config. With UAQ on, the
  masters are reparameterised (q/k/v/gate/up ÷ s, the norms that feed them × s); the export undoes
  that in fp32 before the cast (`apply_uaq(·, 1/s)`), so the checkpoint has the base model's
  parameterisation and a diff against the base shows only what RL changed.
- `--format int8 | fp8 | fp8_block`: what SGLang's `--quantization w8a8_int8 / w8a8_fp8 / fp8`
  load (qurl/models/export8bit.py), quantized from the UAQ-scaled masters exactly as every weight
  sync quantizes them (qurl/quant/named.py `engine_chunks`): the codes and scales the run's 8-bit
  engines held after that step's sync.

The output is written to a temp dir and renamed, so an interrupted export leaves no half checkpoint.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qurl.checkpoint.rundir import CheckpointDir, read_config
from qurl.config import override
from qurl.commands.ranks import run_ranks
from qurl.errors import InputError
from qurl.models.base import base_dir

if TYPE_CHECKING:
    from qurl.train.run_setup import OpenedRun

FORMATS = ("hf", "int8", "fp8", "fp8_block")  # `--format`
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def write_export(opened: OpenedRun, *, out: str, fmt: str, dtype: str, uaq_scale: float) -> str:
    """One learner rank's part of an export (module docstring), on the run's checkpoint opened by
    `on_checkpoint`: the master weights gathered under their HF names; rank 0 writes `out` in
    `fmt` (one of FORMATS), unquantized tensors in `dtype` (a key of DTYPES), undoing UAQ
    (`uaq_scale`, the run's algo.uaq_scale) for `hf`. Returns `out`."""
    from qurl.models.export8bit import write_checkpoint
    from qurl.quant.uaq import apply_uaq

    state = {name: t.detach().to("cpu", torch.float32) for name, t in opened.learner.named_weights()}
    if not opened.main:
        return out
    if fmt == "hf" and uaq_scale != 1.0:
        state = apply_uaq(state, 1.0 / uaq_scale)  # back to the base parameterisation
    model_dir = Path(opened.model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    write_checkpoint(state, config, model_dir, Path(out), "bf16" if fmt == "hf" else fmt,
                     dtype=DTYPES[dtype])
    return out


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
    from qurl.train.run_setup import on_checkpoint

    run_ranks(on_checkpoint, cfg.learner, cfg, str(ckpt), write_export, out=str(out), fmt=fmt,
              dtype=dtype, uaq_scale=cfg.algo.uaq_scale)
    return out


def run(args: argparse.Namespace) -> int:
    """`qurl export` with its parsed arguments (module docstring); the exit code."""
    out = export_run(Path(args.run_dir), Path(args.out), step=args.step, fmt=args.format,
                     dtype=args.dtype)
    print(f"{args.run_dir}: exported ({args.format}) to {out}")
    return 0
