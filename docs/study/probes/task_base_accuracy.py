"""Probe (issue 22, session 14): greedy base accuracy of SmolLM2-135M-Instruct on variants of the
synthetic arithmetic task, to look for a task on which RL improves by degrees rather than in one
jump. Not part of qurl: it uses qurl's engine and reward path directly.

    HF_HUB_OFFLINE=1 .venv/bin/python docs/study/probes/task_base_accuracy.py orig \\
        digits=1,operands=3 digits=2,operands=2 digits=1,operands=4
    HF_HUB_OFFLINE=1 .venv/bin/python docs/study/probes/task_base_accuracy.py steps \\
        digits=1,operands=3 digits=1,operands=4 digits=2,operands=3

First argument: the one-shot example of the chat-1shot template: "orig" (qurl's, "2+5-4 = 3.
\\boxed{3}") or "steps" (one operation at a time: "2+5 = 7. 7-4 = 3. \\boxed{3}"). Each further
argument is one task (data.digits, data.operands; all else the smollm2-arith preset: seed 0's 200
held-out questions), scored greedily with up to 32 new tokens by the unquantized model.
"""
import sys
import time

import torch

import qurl.data.templates as templates
from qurl.config.load import override
from qurl.config.presets import PRESETS
from qurl.data.splits import load_eval_sets
from qurl.engines.factory import make_engine
from qurl.models.registry import models_dir
from qurl.train.generate import to_trajectories
from qurl.train.requests import PromptCodec
from qurl.types import GenRequest, SamplingParams

SHOTS = {"orig": templates.ONE_SHOT, "steps": ("What is 2+5-4?", "2+5 = 7. 7-4 = 3. \\boxed{3}")}

torch.set_num_threads(2)
templates.ONE_SHOT = SHOTS[sys.argv[1]]  # render_prompt reads the module attribute at call time
engine = None
for task in sys.argv[2:]:
    cfg = override(PRESETS["smollm2-arith"](),
                   {f"data.{k}": int(v) for k, v in (kv.split("=") for kv in task.split(","))})
    examples = load_eval_sets(cfg)["synthetic"]
    if engine is None:
        engine = make_engine(cfg, str(models_dir() / "smollm2-135m"),
                             local=True, precision="bf16")
    codec = PromptCodec(engine.tokenizer, cfg.data.template)
    params = SamplingParams(max_new_tokens=32, temperature=0.0,
                            stop_token_ids=(engine.tokenizer.eos_token_id,))
    t0 = time.time()
    reqs = [GenRequest(rid=f"{ex.uid}#0", prompt_ids=codec.encode(ex.prompt), params=params)
            for ex in examples]
    groups = to_trajectories(engine.generate(reqs), examples, codec, reward_timeout_s=5)
    acc = sum(g[0].reward > 0 for g in groups) / len(groups)
    print(f"{sys.argv[1]} {task}: greedy {acc:.3f} on {len(groups)} ({time.time() - t0:.0f} s)")
    for g in groups[:3]:
        print("    ", repr(codec.decode(g[0].response_ids)))
