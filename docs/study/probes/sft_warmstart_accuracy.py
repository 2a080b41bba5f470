"""Probe (issue 22, session 16): does a short SFT warm start on worked answers put SmolLM2-135M-Instruct
where RL can improve it by degrees on the smollm2-arith task, now that the reward takes numerals only?
Not part of qurl: it uses qurl's warm start (qurl/models/warmstart.py), engine and reward directly.

    HF_HUB_OFFLINE=1 .venv/bin/python docs/study/probes/sft_warmstart_accuracy.py \
        10 3e-5 fold 15 3e-5 fold 20 3e-5 fold 30 3e-5 fold

Each (STEPS, LR, STYLE) fine-tunes the fetched model for STEPS AdamW steps of 32 worked answers
(`worked_solution(ex, STYLE)` of seed 0's train split, "6-3=3,3-3=0 \\boxed{0}"; warm-up then cosine
to 0.1 x LR over STEPS, so a shorter run is not a prefix of a longer one), then scores greedy answers
(24 new tokens, bf16 engine, reward kind "number") on seed 0's 200 held-out questions. Session 16,
this 2-core VM: 10 steps 0.5%, 15 steps 16.0%, 20 steps 61.0%, 30 steps 83.0% (the base model 13.5%).
"""
import collections
import json
import sys
import tempfile
import time
import torch
from qurl.config.presets import PRESETS
from qurl.data.splits import load_eval_sets
from qurl.data.synthetic import arithmetic_task, worked_solution
from qurl.data.templates import render_prompt
from qurl.engines.factory import make_engine
from qurl.models.registry import resolve_base
from qurl.models.warmstart import sft_warmstart
from qurl.models.hf import load_checkpoint
from qurl.train.requests import PromptCodec
from qurl.train.generate import to_trajectories
from qurl.types import GenRequest, SamplingParams

cfg = PRESETS["smollm2-arith"]()
base = resolve_base(cfg.model.base)
_, tok = load_checkpoint(base, dtype=torch.float32)
train = arithmetic_task(2000, seed=0, split="train", digits=1, n_operands=3, at_most=True)
exs = load_eval_sets(cfg)["synthetic"]
args = sys.argv[1:]
scratch = tempfile.mkdtemp(prefix="qurl-sft-probe-")
for i in range(0, len(args), 3):
    steps, lr, style = int(args[i]), float(args[i + 1]), args[i + 2]
    pairs = [(render_prompt(e.prompt, cfg.data.template, tokenizer=tok), worked_solution(e, style)) for e in train]
    if i == 0: print("example pair:", repr(pairs[0][1]), flush=True)
    t0 = time.time()
    out = sft_warmstart(base, pairs, steps=steps, lr=lr, batch_size=32, seed=0,
                        out_dir=f"{scratch}/sft_{steps}_{lr}_{style}", num_threads=2)
    t1 = time.time()
    engine = make_engine(cfg, str(out), local=True, precision="bf16")
    codec = PromptCodec(engine.tokenizer, cfg.data.template)
    p = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(engine.tokenizer.eos_token_id,))
    res = engine.generate([GenRequest(rid=f"{e.uid}#0", prompt_ids=codec.encode(e.prompt), params=p) for e in exs])
    groups = to_trajectories(res, exs, codec, reward_timeout_s=5)
    acc = sum(g[0].reward for g in groups) / len(groups)
    byop = collections.defaultdict(list)
    for e, g in zip(exs, groups): byop["".join(c for c in e.prompt if c in "+-")].append(g[0].reward)
    ws = json.load(open(out / "warmstart.json"))
    print(f"SFT {steps} steps lr {lr} {style}: loss {ws['loss_first']:.3f}->{ws['loss_last']:.3f} "
          f"({t1-t0:.0f}s)  greedy {acc:.3f}  by op " +
          " ".join(f"{k}:{sum(v)/len(v):.2f}" for k, v in sorted(byop.items())), flush=True)
    for e, r in list(zip(exs, res))[:3]:
        print("   ", e.prompt + e.answer, repr(codec.decode(r.output_ids)), flush=True)
    engine.close()
