"""The base model RL starts from: a given checkpoint (`model.base` = its path, or the name of a
model `qurl fetch` got: `qurl.models.registry`) or one built here.

The CPU default has no hub to download from, so its base model is made here: a tiny Qwen2 with a
character tokenizer, warm-started by a short supervised fine-tune on worked solutions of the
synthetic training split (RL needs a policy that is sometimes right). A checkpoint can be warm-started
the same way (`model.warmstart_checkpoint`): a pretrained model that is right on ~14% of questions
gives groups that are mostly all-wrong, and a few supervised steps put it where RL improves it by
degrees (docs/study/smollm2_regime.md). A built base is cached under
`<deploy.dir>/_base/<name>-<key>/`, keyed by everything that determines it (for a checkpoint, also
its config and its files' names and sizes), and linked or copied into the run directory so a run can
always be resumed from its own files.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable, TypeVar

from qurl.config import LOCAL_BASES, DataConfig, DeployConfig, ModelConfig
from qurl.data.synthetic import arithmetic_task, worked_solution
from qurl.data.templates import render_prompt

T = TypeVar("T")


# The warm start fine-tunes on its own fixed set of synthetic training questions (as many as the
# default training split, or all an easy task has), not on data.train_size of them: a run's base
# model then does not change with how many RL prompts it uses, and runs (and tests) with the same
# recipe share one build.
WARMSTART_QUESTIONS = 2000


def builds_base(m: ModelConfig) -> bool:
    """Whether the run's base model is built here (tiny/small, or a warm-started checkpoint) and
    lives in the run dir, rather than read from model.base as it is."""
    return m.base in LOCAL_BASES or (m.warmstart_checkpoint and m.warmstart_steps > 0)


def base_dir(model: ModelConfig, run_dir: Path) -> Path:
    """The HF checkpoint a run in `run_dir` with `[model]` section `model` started from (config,
    tokenizer, chat template): the run directory's base_model/ for a model built here, once
    `prepare_base_model` has put it there, else model.base resolved."""
    from qurl.models.registry import resolve_base

    return Path(run_dir) / "base_model" if builds_base(model) else Path(resolve_base(model.base))


def _checkpoint_identity(path: Path) -> dict:
    """What tells one checkpoint from another cheaply: its config.json and its files' names, sizes."""
    files = sorted(f for f in path.iterdir() if f.is_file())
    return {"config": (path / "config.json").read_text(),
            "files": [[f.name, f.stat().st_size] for f in files]}


def _base_key(m: ModelConfig, d: DataConfig, seed: int, checkpoint: Path | None = None) -> str:
    ident = {"preset": m.base, "seed": seed, "steps": m.warmstart_steps,
             "lr": m.warmstart_lr, "digits": d.digits, "operands": d.operands, "template": d.template,
             "questions": WARMSTART_QUESTIONS, "v": 3}
    # Not in the key: how the warm start got its bf16 matmuls (native or emulated, warmstart.py),
    # nor that qurl before the emulation warm-started in fp32 on CPUs without native bf16. A
    # study's runs (`--train-code`, an older checkout) look the base up by this key too, and a new
    # field would make each of them build it again; a study refuses a start of the other precision
    # (qurl/research/studies/store.py, check_start), and a cache is one machine's (deploy.dir).
    if checkpoint is not None:
        ident["checkpoint"] = _checkpoint_identity(checkpoint)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link a cached file into the run dir (the cache is written once, never in place), or
    copy it where links cannot be made (another file system)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def prepare_base_model(model: ModelConfig, data: DataConfig, seed: int, deploy: DeployConfig,
                       run_dir: Path) -> str:
    """Return the HF checkpoint dir RL starts from (inside the run dir for built models); the
    arguments are build_base's."""
    from qurl.models.hf import check_checkpoint
    from qurl.models.registry import resolve_base

    if not builds_base(model):
        path = resolve_base(model.base)
        check_checkpoint(path)
        return path
    target = Path(run_dir) / "base_model"
    if (target / "config.json").exists():
        return str(target)
    shutil.copytree(build_base(model, data, seed, deploy), target, dirs_exist_ok=True,
                    copy_function=_link_or_copy)
    return str(target)


def build_base(m: ModelConfig, data: DataConfig, seed: int, deploy: DeployConfig) -> Path:
    """The cached base model (`<deploy.dir>/_base/<name>-<key>/`) of a run that builds_base: built
    (tiny/small) or read (a checkpoint) and warm-started first if missing. A caller asking for a
    key another thread or process is building waits for it (a file lock beside the cache). What
    it reads: the run's `[model]`, the synthetic task of `[data]` (digits, operands, template),
    its seed (run.seed), and deploy.dir, deploy.torch_threads."""
    from qurl.models.hf import build_model, check_checkpoint
    from qurl.models.registry import resolve_base
    from qurl.models.warmstart import sft_warmstart

    if not builds_base(m):
        raise ValueError(f"model.base={m.base!r} is used as given (model.warmstart_checkpoint is "
                         "off or model.warmstart_steps is 0): there is no base to build")
    checkpoint = None if m.base in LOCAL_BASES else Path(resolve_base(m.base))
    if checkpoint is not None:
        check_checkpoint(checkpoint)
    name = m.base if checkpoint is None else checkpoint.name
    cache = Path(deploy.dir) / "_base" / f"{name}-{_base_key(m, data, seed, checkpoint)}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    # one builder per key, across threads and processes (two studies, or two arms of one seed,
    # started together): the others wait on the lock and then find the cache
    with open(cache.parent / f"{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / "config.json").exists():
            tmp = cache.with_name(cache.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            init = checkpoint or build_model(tmp / "init", m.base, seed=seed)
            if m.warmstart_steps > 0:
                sft_warmstart(init, _warmstart_pairs(m.base, data, seed, init),
                              steps=m.warmstart_steps, lr=m.warmstart_lr, batch_size=32,
                              seed=seed, out_dir=tmp / "sft",
                              num_threads=deploy.torch_threads or None)
                shutil.move(str(tmp / "sft"), str(cache))
            else:
                shutil.move(str(init), str(cache))
            shutil.rmtree(tmp, ignore_errors=True)
        return cache


def _warmstart_pairs(base: str, d: DataConfig, seed: int, model_dir: Path
                     ) -> list[tuple[str, str]]:
    """(prompt as the run renders it, worked solution) for the warm start's fixed training questions."""
    from transformers import AutoTokenizer

    from qurl.models.tokenizer import build_tokenizer

    tok = (build_tokenizer() if base in LOCAL_BASES
           else AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True))
    train = arithmetic_task(WARMSTART_QUESTIONS, seed=seed, split="train",
                            digits=d.digits, n_operands=d.operands, at_most=True)
    return [(render_prompt(ex.prompt, d.template, tokenizer=tok), worked_solution(ex))
            for ex in train]


def build_base_apart(model: ModelConfig, data: DataConfig, seed: int, deploy: DeployConfig) -> Path:
    """build_base in a child process, for a caller that lives on after it and starts runs beside
    it (a study): the warm start's optimizer state and activations (~7 GB on SmolLM2-135M) stay in
    the heap of the process that ran it even when freed, and would sit in the caller's memory for
    hours next to the runs it trains. A child's goes back to the system when it exits. Errors are
    the child's, raised here; a child killed outright (the kernel's out-of-memory killer: one
    SmolLM2-135M warm start peaked at 12.7-12.8 GB on a 24-GB machine, so two at once may not fit) is a
    RuntimeError, not a wait without end."""
    return run_apart(build_base, model, data, seed, deploy)


def run_apart(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a spawned child process; its result or its exception here. multiprocessing.Pool
    would wait forever for a child killed by a signal (it starts a new worker and loses the task);
    a ProcessPoolExecutor marks itself broken, which is raised as a RuntimeError."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} died in its child process before it "
                               "returned (killed by a signal, most often the out-of-memory killer): "
                               "run it again with more memory free") from e
