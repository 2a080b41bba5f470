"""Probe (issue 22, session 16): what a trained run actually answers. Loads a run directory's latest
checkpoint into a learner, pushes it into the run's own engine (8-bit for an int8 arm, as `qurl eval`
does) and prints the greedy responses and rewards on the first N held-out questions whose operators
read PATTERN ("+-" for a+b-c). Not part of qurl.

    HF_HUB_OFFLINE=1 .venv/bin/python docs/study/probes/checkpoint_answers.py RUN_DIR "+-" 12

Session 16 found with it that the study's learned runs boxed the question itself
(docs/study/smollm2_regime.md, "The reward accepted the question as its answer").
"""
import sys
from pathlib import Path
import torch
from qurl.config import override, validate
from qurl.commands.ranks import run_ranks
from qurl.engines.factory import engine_wire_dtype, make_engine
from qurl.learner.dist import init_learner_dist
from qurl.learner.megatron import MegatronLearner
from qurl.models.registry import resolve_base
from qurl.weights.publish import WeightSync
from qurl.train.rundir import CheckpointDir, read_config
from qurl.data.splits import load_eval_sets
from qurl.train.requests import PromptCodec
from qurl.train.generate import to_trajectories
from qurl.types import GenRequest, SamplingParams

def entry(cfg, *, ckpt, pattern, n, rank, world_size):
    torch.set_num_threads(1)
    init_learner_dist(cfg.learner, rank, world_size, deploy=cfg.deploy)
    model_dir = resolve_base(cfg.model.base)
    learner = MegatronLearner(model_dir, cfg.model, cfg.algo, cfg.optim, cfg.learner,
                              total_steps=cfg.run.steps, seed=cfg.run.seed, deploy=cfg.deploy)
    learner.load(Path(ckpt))
    engine = make_engine(cfg, model_dir)
    WeightSync(cfg.rollout.precision, wire_dtype=engine_wire_dtype(cfg, model_dir)).push(
        learner.named_weights(), engine, version=0)
    exs = [e for e in load_eval_sets(cfg)["synthetic"]
           if "".join(c for c in e.prompt if c in "+-*") == pattern][:n]
    codec = PromptCodec(engine.tokenizer, cfg.data.template)
    p = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(engine.tokenizer.eos_token_id,))
    outs = engine.generate([GenRequest(rid=f"{e.uid}#0", prompt_ids=codec.encode(e.prompt), params=p) for e in exs])
    for e, g in zip(exs, to_trajectories(outs, exs, codec, reward_timeout_s=5)):
        t = g[0]
        print(f"{e.prompt}{e.answer}  reward {t.reward}  -> {codec.decode(torch.as_tensor(t.response_ids))!r}", flush=True)
    engine.close()
    return {}

run = Path(sys.argv[1])
cfg = override(read_config(run), {"deploy.dir": str(run.parent), "run.name": run.name})
cfg = validate(cfg)
run_ranks(entry, cfg, ckpt=str(CheckpointDir(run).latest()), pattern=sys.argv[2], n=int(sys.argv[3]))
