"""Which engine evaluates which policy, and the bound on local evaluation engines on the learner's
GPU (issue 59 item 7; qurl/train/eval_placement.py). Pure decisions: testable without CUDA."""
from __future__ import annotations

import pytest

from qurl.config import ConfigError, load_config
from qurl.train import eval_placement as ep
from qurl.train.eval_placement import local_eval_bytes
from qurl.learner.memory_plan import KNOWN_SHAPES

R1_15B = KNOWN_SHAPES["deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"]


def eval_placement(cfg, **kw):
    return ep.eval_placement(cfg.eval, cfg.rollout, **kw)


def check_eval(cfg, placement, fields, n_problems):
    ep.check_eval(cfg.eval, cfg.deploy, placement, fields, n_problems)


def test_placement_by_loop_and_precision():
    cfg = load_config(sets=["rollout.precision=int8"])
    assert eval_placement(cfg, cuda=True, asynchronous=False).local_engines == ["fp"]
    # the async actor is answered by the rollout workers: only the fp policy is ever local
    assert eval_placement(cfg, cuda=True, asynchronous=True).local_engines == ["fp"]
    assert eval_placement(cfg, cuda=True, asynchronous=True).actor == "workers"
    off = load_config(sets=["rollout.precision=int8", "eval.fp_policy=false"])
    assert eval_placement(off, cuda=True, asynchronous=False).local_engines == []
    bf16 = load_config(sets=["rollout.precision=bf16"])
    assert not eval_placement(bf16, cuda=False, asynchronous=False).fp


def test_paper_eval_on_the_learner_gpu_is_refused_in_one_line():
    """Avg@32 at 8k tokens of the 1.5B preset, with the fp policy opted in: ~120 GB of KV."""
    cfg = load_config("paper-deepscaler-1.5b", sets=["eval.fp_policy=true"])
    gpu = eval_placement(cfg, cuda=True, asynchronous=False)
    with pytest.raises(ConfigError) as err:
        check_eval(cfg, gpu, R1_15B, n_problems=30)
    msg = str(err.value)
    assert "\n" not in msg and "eval.fp_policy" in msg and "deploy.eval_gpu_gb=8" in msg
    kv_only = local_eval_bytes(R1_15B, rows=256, tokens=512 + 8192, weight_bytes=0)
    assert 110e9 < kv_only - 151936 * 1536 * 8 < 130e9  # ~120 GB of fp32 KV cache
    # the same evaluation on CPU (host memory) is not checked; raising the budget admits it
    check_eval(cfg, eval_placement(cfg, cuda=False, asynchronous=False), R1_15B, 30)
    big = load_config("paper-deepscaler-1.5b", sets=["eval.fp_policy=true",
                                                     "deploy.eval_gpu_gb=200"])
    check_eval(big, eval_placement(big, cuda=True, asynchronous=False), R1_15B, 30)


def test_async_actor_evaluation_needs_no_room_on_the_learner_gpu():
    """The paper preset (eval.fp_policy off): Avg@32 at 8k tokens, async, on a GPU, is admitted,
    since the workers' servers answer it; the fp policy opted in is still bounded."""
    cfg = load_config("paper-deepscaler-1.5b")
    check_eval(cfg, eval_placement(cfg, cuda=True, asynchronous=True), R1_15B, 30)
    fp = load_config("paper-deepscaler-1.5b", sets=["eval.fp_policy=true"])
    with pytest.raises(ConfigError, match="eval.fp_policy"):
        check_eval(fp, eval_placement(fp, cuda=True, asynchronous=True), R1_15B, 30)
    small = load_config(sets=["rollout.precision=int8"])  # the CPU default: greedy, 32 tokens
    smol = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    check_eval(small, eval_placement(small, cuda=True, asynchronous=True), smol, 64)
