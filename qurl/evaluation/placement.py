"""Which engine evaluates which policy, and whether a local evaluation engine fits (issue 59 item 7).

Two policies are scored (qurl/evaluation/suite.py): the 8-bit actor (`eval/...`) and, with
eval.fp_policy, the full-precision master weights (`eval_fp/...`). Where:

- the synchronous loop scores the actor on its own rollout engine (SGLang servers, or the local
  engine it rolls out with): nothing new is loaded anywhere;
- the asynchronous controller holds no rollout engine (its workers do) and scores the actor with
  a LOCAL decoder in learner rank 0's process, on its GPU when it has one;
- the fp policy is always a local fp32 decoder in rank 0's process.

A local decoder on the learner's GPU takes the weights plus the KV cache of its largest batch
(LocalEngine: up to 256 rows, fp32 cache): Avg@32 at 8k tokens is ~120 GB at 1.5B, far beyond
what the learner leaves free. So on CUDA every local evaluation engine is checked at start
against deploy.eval_gpu_gb and refused in one line (`check_eval`) naming what it would take and
what to change; on CPU nothing is checked (host memory, the small CPU presets: `make run` is
unchanged, its fp policy included). `eval_placement` is the decision, pure and testable without
a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qurl.config import Config, ConfigError

LOCAL_MAX_BATCH = 256  # rows a LocalEngine decodes at once (qurl/engines/local.py max_batch)
PROMPT_TOKENS = 512  # prompt tokens assumed in front of eval.max_new_tokens (as learner/plan.py)
GB = 1e9


@dataclass(frozen=True)
class EvalPlacement:
    """actor: "rollout" (the sync loop's rollout engine) or "local" (a decoder in rank 0's
    process); fp: whether the full-precision policy is scored; on_gpu: whether local engines sit
    on the learner's GPU (then they are checked against deploy.eval_gpu_gb)."""
    actor: str
    fp: bool
    on_gpu: bool

    @property
    def local_engines(self) -> list[str]:
        """The local evaluation engines on rank 0: "actor" (8-bit), "fp" (fp32)."""
        return (["actor"] if self.actor == "local" else []) + (["fp"] if self.fp else [])


def eval_placement(cfg: Config, *, cuda: bool, asynchronous: bool) -> EvalPlacement:
    """Which engine scores which policy (module docstring)."""
    fp = cfg.eval.fp_policy and cfg.rollout.precision != "bf16"
    return EvalPlacement(actor="local" if asynchronous else "rollout", fp=fp, on_gpu=cuda)


def local_eval_bytes(fields: dict[str, Any], *, rows: int, tokens: int, weight_bytes: float
                     ) -> float:
    """Weights + fp32 KV cache of `rows` rows of `tokens` tokens for the model whose config.json
    fields are `fields`; weight_bytes: bytes per parameter of the engine (4 fp32, ~1 8-bit)."""
    h, layers = int(fields["hidden_size"]), int(fields["num_hidden_layers"])
    heads = int(fields["num_attention_heads"])
    kv_heads = int(fields.get("num_key_value_heads") or heads)
    head_dim = int(fields.get("head_dim") or h // heads)
    ffn, vocab = int(fields["intermediate_size"]), int(fields["vocab_size"])
    layer = (heads + 2 * kv_heads) * head_dim * h + heads * head_dim * h + 3 * ffn * h
    embed = vocab * h * (1 if fields.get("tie_word_embeddings") else 2)
    weights = layers * layer * weight_bytes + embed * 4  # embeddings stay full precision
    kv = rows * tokens * layers * 2 * kv_heads * head_dim * 4
    return weights + kv


def check_eval(cfg: Config, placement: EvalPlacement, fields: dict[str, Any] | None,
               n_problems: int) -> None:
    """Refuse, in one line, a local evaluation engine on the learner's GPU estimated over
    deploy.eval_gpu_gb. `fields`: the model's config.json fields (None: cannot estimate, so
    nothing is checked); n_problems: problems over all eval sets."""
    if not placement.on_gpu or fields is None or not placement.local_engines:
        return
    e = cfg.eval
    requests = n_problems * max(1 if e.greedy else 0, e.samples)
    rows = max(1, min(LOCAL_MAX_BATCH, requests))
    tokens = PROMPT_TOKENS + e.max_new_tokens
    budget = cfg.deploy.eval_gpu_gb * GB
    for who in placement.local_engines:
        try:
            need = local_eval_bytes(fields, rows=rows, tokens=tokens,
                                    weight_bytes=4.0 if who == "fp" else 1.0)
        except (KeyError, TypeError, ValueError):
            return  # a config.json without the usual shape fields: cannot estimate
        if need > budget:
            what = ("the full-precision policy (eval.fp_policy)" if who == "fp" else
                    "the async controller's 8-bit actor")
            fix = "set eval.fp_policy=false" if who == "fp" else \
                "evaluate with the synchronous loop's rollout servers (deploy.rollout=inline)"
            raise ConfigError(
                f"evaluation: {what} would take ~{need / GB:.1f} GB on learner rank 0's GPU (a "
                f"local decoder: weights + fp32 KV of {rows} rows x {tokens} tokens) but "
                f"deploy.eval_gpu_gb={cfg.deploy.eval_gpu_gb:g}: {fix}, lower eval.samples "
                f"(now {e.samples}) or eval.max_new_tokens (now {e.max_new_tokens}), or raise "
                f"deploy.eval_gpu_gb")
