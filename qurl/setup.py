"""Build what a run runs on, out of its config: CPU thread counts and the rollout engine.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from qurl.config import Config
from qurl.engines.base import Engine


def busy_processes(cfg: Config, world_size: int, *, workers: bool = True) -> int:
    """qurl processes computing at the same time on this node: the learner's ranks here
    (nproc_per_node across nodes), plus the local rollout workers when their generation overlaps
    training (async with η ≥ 1 or several workers, on CPU; not with workers=False)."""
    import torch

    r = cfg.rollout
    ranks = cfg.learner.nproc_per_node if cfg.learner.nnodes > 1 else world_size
    overlap = (workers and r.mode == "async" and r.workers == "local"
               and not torch.cuda.is_available() and (r.max_staleness > 0 or r.num_workers > 1))
    return ranks + (r.num_workers if overlap else 0)


def set_threads(cfg: Config, busy: int = 1) -> int:
    """Pin torch's CPU threads for this process and return the count: run.torch_threads when set,
    else (auto) this node's cores divided among the `busy` processes computing at once
    (`busy_processes`). So the sync loop runs generation and training each on every core, and an
    async run splits the cores between learner and workers: `qurl compare` gives every arm the
    same machine."""
    import torch

    n = cfg.run.torch_threads
    if n <= 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        n = max(1, (cores or 1) // max(1, busy))
    torch.set_num_threads(n)
    return n


def make_engine(cfg: Config, model_dir: str, *, slot: int | None = None, host: str = "",
                local: bool = False) -> Engine:
    """The rollout engine of the sync loop (slot None) or of async worker `slot` (`host`: the
    worker's address, where SGLang servers reach its weight group). local=True: a LocalEngine
    whatever rollout.engine says — the async controller's evaluation engine, which must not take
    the workers' SGLang servers; block-scaled FP8, which it does not run, becomes per-channel FP8.
    The local engine runs on this process's current GPU when there is one."""
    if cfg.rollout.engine == "local" or local:
        import torch

        from qurl.engines.local import LocalEngine

        precision = "fp8" if cfg.rollout.precision == "fp8_block" else cfg.rollout.precision
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        return LocalEngine(model_dir, precision=precision, seed=cfg.run.seed, device=device)
    from qurl.engines.sglang import SGLangEngine

    return SGLangEngine.from_config(cfg, model_dir, slot=slot, group_host=host)


_SGLANG_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                  "float": "float32", "float32": "float32"}


def engine_wire_dtype(cfg: Config, model_dir: str | Path) -> "torch.dtype | None":
    """The dtype the rollout engines hold full-precision tensors in (embeddings, lm_head, norms,
    biases; everything with precision bf16), which is the dtype the weight sync sends them in
    (qurl.quant.named.travels_as). None for the local engine: it computes in fp32, as the masters.

    SGLang servers: `--dtype` from rollout.sglang_args, else SGLang's "auto" rule (0.5.23,
    configs/model_config.py): the checkpoint's dtype, and an fp32 checkpoint served in fp16 (bf16
    for Gemma models). A server launched with another dtype still loads what it is sent (its
    weight loaders cast), at the cost of a second rounding."""
    import torch

    if cfg.rollout.engine != "sglang":
        return None
    args = list(cfg.rollout.sglang_args)
    flag = "auto"
    for i, a in enumerate(args):
        if a == "--dtype" and i + 1 < len(args):
            flag = args[i + 1].lower()
        elif a.startswith("--dtype="):
            flag = a.split("=", 1)[1].lower()
    if flag == "auto":
        meta = json.loads((Path(model_dir) / "config.json").read_text())
        name = meta.get("dtype") or meta.get("torch_dtype") or "float32"
        if _SGLANG_DTYPES.get(str(name)) in (None, "float32"):
            gemma = str(meta.get("model_type", "")).startswith("gemma")
            flag = "bfloat16" if gemma else "float16"
        else:
            flag = str(name)
    if flag not in _SGLANG_DTYPES:
        raise ValueError(f"rollout.sglang_args --dtype {flag!r}: expected auto or one of "
                         f"{', '.join(_SGLANG_DTYPES)}")
    return getattr(torch, _SGLANG_DTYPES[flag])
