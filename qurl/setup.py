"""Build what a run starts from, out of its config: the base model, the data splits, the engine.

The CPU default has no hub to download from, so its base model is made here: a tiny Qwen2 with a
character tokenizer, warm-started by a short supervised fine-tune on worked solutions of the
synthetic training split (RL needs a policy that is sometimes right). The result is cached under
`runs/_base/<key>/`, keyed by everything that determines it, and copied into the run directory so a
run can always be resumed from its own files.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from qurl.config import Config
from qurl.data.datasets import Example, load_dataset
from qurl.data.synthetic import arithmetic_task, worked_solution
from qurl.data.templates import render_prompt
from qurl.engines.base import Engine

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _resolve_data_path(path: str) -> Path:
    p = Path(path)
    if p.exists():
        return p
    if (SHARED_DATA / path).exists():
        return SHARED_DATA / path
    raise FileNotFoundError(f"data file {path!r} not found (also looked in {SHARED_DATA})")


def load_datasets(cfg: Config) -> tuple[list[Example], list[Example]]:
    d = cfg.data

    def one(source: str, split: str, n: int) -> list[Example]:
        if source == "synthetic":
            return arithmetic_task(n, seed=cfg.run.seed, split=split, digits=d.digits,
                                   n_operands=d.operands)
        return load_dataset(_resolve_data_path(source), d.format,
                            question_field=d.question_field or None,
                            answer_field=d.answer_field or None,
                            limit=n if split == "eval" else None)

    return one(d.train, "train", d.train_size), one(d.eval, "eval", d.eval_size)


def _base_key(cfg: Config) -> str:
    m, d = cfg.model, cfg.data
    ident = {"preset": m.preset, "seed": cfg.run.seed, "steps": m.warmstart_steps,
             "lr": m.warmstart_lr, "digits": d.digits, "operands": d.operands, "template": d.template, "v": 2}
    if m.warmstart_steps > 0:  # the warm start fine-tunes on the first train_size training questions
        ident["train_size"] = d.train_size
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def prepare_base_model(cfg: Config, run_dir: Path) -> str:
    """Return the HF checkpoint dir RL starts from (inside the run dir for built models)."""
    from qurl.models.hf import build_model, check_checkpoint
    from qurl.models.tokenizer import build_tokenizer
    from qurl.models.warmstart import sft_warmstart

    if cfg.model.preset == "path":
        check_checkpoint(cfg.model.path)
        return cfg.model.path
    target = Path(run_dir) / "base_model"
    if (target / "config.json").exists():
        return str(target)
    cache = Path(cfg.run.dir) / "_base" / f"{cfg.model.preset}-{_base_key(cfg)}"
    if not (cache / "config.json").exists():
        tmp = cache.with_name(cache.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        init = build_model(tmp / "init", cfg.model.preset, seed=cfg.run.seed)
        if cfg.model.warmstart_steps > 0:
            tok = build_tokenizer()
            train = arithmetic_task(cfg.data.train_size, seed=cfg.run.seed, split="train",
                                    digits=cfg.data.digits, n_operands=cfg.data.operands)
            pairs = [(render_prompt(ex.prompt, cfg.data.template, tokenizer=tok),
                      worked_solution(ex)) for ex in train]
            sft_warmstart(init, pairs, steps=cfg.model.warmstart_steps, lr=cfg.model.warmstart_lr,
                          batch_size=32, seed=cfg.run.seed, out_dir=tmp / "sft",
                          num_threads=cfg.run.torch_threads or None)
            shutil.move(str(tmp / "sft"), str(cache))
        else:
            shutil.move(str(init), str(cache))
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cache, target, dirs_exist_ok=True)
    return str(target)


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
