"""The base model RL starts from: a given checkpoint (`model.base` = its path, or the name of a
model `qurl fetch` got: `qurl.models.registry`) or one built here.

The CPU default has no hub to download from, so its base model is made here: a tiny Qwen2 with a
character tokenizer, warm-started by a short supervised fine-tune on worked solutions of the
synthetic training split (RL needs a policy that is sometimes right). The result is cached under
`runs/_base/<key>/`, keyed by everything that determines it, and copied into the run directory so a
run can always be resumed from its own files.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from qurl.config import LOCAL_BASES, Config
from qurl.data.synthetic import arithmetic_task, worked_solution
from qurl.data.templates import render_prompt


# The warm start fine-tunes on its own fixed set of synthetic training questions (as many as the
# default training split, or all an easy task has), not on data.train_size of them: a run's base
# model then does not change with how many RL prompts it uses, and runs (and tests) with the same
# recipe share one build.
WARMSTART_QUESTIONS = 2000


def _base_key(cfg: Config) -> str:
    m, d = cfg.model, cfg.data
    ident = {"preset": m.base, "seed": cfg.run.seed, "steps": m.warmstart_steps,
             "lr": m.warmstart_lr, "digits": d.digits, "operands": d.operands, "template": d.template,
             "questions": WARMSTART_QUESTIONS, "v": 3}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def prepare_base_model(cfg: Config, run_dir: Path) -> str:
    """Return the HF checkpoint dir RL starts from (inside the run dir for built models)."""
    from qurl.models.hf import check_checkpoint
    from qurl.models.registry import resolve_base

    if cfg.model.base not in LOCAL_BASES:
        path = resolve_base(cfg.model.base)
        check_checkpoint(path)
        return path
    target = Path(run_dir) / "base_model"
    if (target / "config.json").exists():
        return str(target)
    shutil.copytree(build_base(cfg), target, dirs_exist_ok=True)
    return str(target)


def build_base(cfg: Config) -> Path:
    """The cached base model of model.base tiny/small (`<deploy.dir>/_base/<base>-<key>/`), built and
    warm-started first if missing. Two processes must not build the same key at once (they share
    its .tmp dir): callers that start runs side by side build it once beforehand."""
    from qurl.models.hf import build_model
    from qurl.models.tokenizer import build_tokenizer
    from qurl.models.warmstart import sft_warmstart

    cache = Path(cfg.deploy.dir) / "_base" / f"{cfg.model.base}-{_base_key(cfg)}"
    if not (cache / "config.json").exists():
        tmp = cache.with_name(cache.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        init = build_model(tmp / "init", cfg.model.base, seed=cfg.run.seed)
        if cfg.model.warmstart_steps > 0:
            tok = build_tokenizer()
            train = arithmetic_task(WARMSTART_QUESTIONS, seed=cfg.run.seed, split="train",
                                    digits=cfg.data.digits, n_operands=cfg.data.operands,
                                    at_most=True)
            pairs = [(render_prompt(ex.prompt, cfg.data.template, tokenizer=tok),
                      worked_solution(ex)) for ex in train]
            sft_warmstart(init, pairs, steps=cfg.model.warmstart_steps, lr=cfg.model.warmstart_lr,
                          batch_size=32, seed=cfg.run.seed, out_dir=tmp / "sft",
                          num_threads=cfg.deploy.torch_threads or None)
            shutil.move(str(tmp / "sft"), str(cache))
        else:
            shutil.move(str(init), str(cache))
        shutil.rmtree(tmp, ignore_errors=True)
    return cache
