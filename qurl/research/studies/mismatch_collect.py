"""Collect the 8-bit mismatch of a real model: behaviour log-probs from qurl's rollout engine at
each precision, proximal log-probs from the Megatron learner (bf16 and fp32), saved per stage.

    python -m qurl.research.studies.mismatch_collect gen   --out DIR --precision int8
    python -m qurl.research.studies.mismatch_collect score --out DIR --precision int8 --learner-dtype bfloat16

`gen`: `--prompts` synthetic arithmetic questions (2 operands, 2 digits, + and -) rendered with the
model's chat template (the boxed instruction as the user turn), `--group` samples each at
temperature 1.0 (top-p 1), `--new-tokens` at most, by `make_engine` (the local engine as training
builds it: its "bf16" precision computes in fp32; int8/fp8 are W8A8 per-channel, w4a16 int4
groups of 128) — then scored by the verifiable reward and packed by `build_batch` (GRPO advantages,
the training batch layout). Written to DIR/gen_<precision>.pt: tokens, loss_mask, behav_logp, adv,
rewards [B] and the prompt length of each row.

`score`: the learner (`MegatronLearner`, TP 1, UAQ off so its function is the checkpoint's) computes
log π_prox of every token of that batch, as a training step's first forward does; written to
DIR/prox_<precision>_<dtype>.pt. Stages are separate processes so a long collection can be resumed
and the CPU shared; the analysis is qurl.research.studies.mismatch, the page qurl.research.studies.mismatch_report.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

PRECISIONS = ("bf16", "int8", "fp8", "w4a16")
DTYPES = ("bfloat16", "float32")


def study_config(model: str, precision: str, learner_dtype: str = "bfloat16", seed: int = 0):
    """The qurl Config of one arm: the real model, local engine, chat template, UAQ off."""
    from qurl.config import load_config

    return load_config("cpu-tiny", sets=[
        f"model.base={model}", "model.warmstart_steps=0", f"model.dtype={learner_dtype}",
        "data.template=chat", f"rollout.precision={precision}", "rollout.engine=local",
        "algo.uaq_scale=1.0", f"run.seed={seed}"])


def questions(n: int, seed: int):
    from qurl.data.synthetic import arithmetic_task

    return arithmetic_task(n, seed=seed, split="train", digits=2, n_operands=2, ops="+-")


def gen(out: Path, precision: str, model: str, n_prompts: int, group: int, new_tokens: int,
        seed: int) -> Path:
    from qurl.engines.factory import ServerSite, make_engine
    from qurl.models.registry import resolve_base
    from qurl.train.batch import build_batch
    from qurl.train.generate import rollout
    from qurl.train.requests import PromptCodec
    from qurl.types import SamplingParams
    from qurl.weights.settings import SyncSettings

    cfg = study_config(model, precision, seed=seed)
    model_dir = resolve_base(model)
    engine = make_engine(cfg.rollout, cfg.sglang, SyncSettings.of(cfg.deploy.sync), model_dir,
                         seed=cfg.run.seed,
                         site=ServerSite.of(cfg.deploy, cfg.run, cfg.algo, cfg.learner))
    codec = PromptCodec(engine.tokenizer, "chat")
    exs = questions(n_prompts, seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens)
    t0 = time.perf_counter()
    groups, timing = rollout(engine, exs, codec, params, group_size=group, run_seed=seed, step=0,
                             reward_timeout_s=5.0)
    batch, _ = build_batch(groups, version=0, pad_id=engine.pad_id)
    prompt_len = torch.tensor([len(t.prompt_ids) for g in groups for t in g])
    path = out / f"gen_{precision}.pt"
    torch.save({"tokens": batch.tokens, "loss_mask": batch.loss_mask.bool(),
                "behav_logp": batch.behav_logp, "adv": batch.adv, "rewards": batch.rewards,
                "prompt_len": prompt_len, "precision": precision, "model": model,
                "new_tokens": new_tokens, "seconds": time.perf_counter() - t0,
                "tokens_per_s": timing["rollout_tokens_per_s"]}, path)
    return path


def score(out: Path, precision: str, dtype: str, model: str, seed: int) -> Path:
    from qurl.learner.dist import destroy_learner_dist, free_port, init_learner_dist
    from qurl.learner.megatron import MegatronLearner
    from qurl.models.registry import resolve_base

    data = torch.load(out / f"gen_{precision}.pt")
    cfg = study_config(model, precision, dtype, seed)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    init_learner_dist(cfg.learner, 0, 1, ranks=cfg.deploy.ranks, host=cfg.deploy.host)
    try:
        t0 = time.perf_counter()
        learner = MegatronLearner(resolve_base(model), cfg.model, cfg.algo, cfg.optim, cfg.learner,
                                  total_steps=1, seed=seed, ranks=cfg.deploy.ranks)
        prox = learner.logprobs(data["tokens"], temperature=1.0).cpu()
        path = out / f"prox_{precision}_{dtype}.pt"
        torch.save({"prox_logp": prox, "seconds": time.perf_counter() - t0}, path)
    finally:
        destroy_learner_dist()
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.mismatch_collect",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("gen", "score"))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--precision", required=True, choices=PRECISIONS)
    p.add_argument("--learner-dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.stage == "score" and not (a.out / f"gen_{a.precision}.pt").is_file():
        print(f"{a.out / f'gen_{a.precision}.pt'}: missing; run the gen stage first", file=sys.stderr)
        return 2
    path = (gen(a.out, a.precision, a.model, a.prompts, a.group, a.new_tokens, a.seed)
            if a.stage == "gen" else score(a.out, a.precision, a.learner_dtype, a.model, a.seed))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
