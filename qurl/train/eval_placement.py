"""Which engine evaluates which policy, and whether a local evaluation engine fits (issue 59 item 7).

Two policies are scored (eval_suite.py): the 8-bit actor (`eval/...`) and, with
eval.fp_policy, the full-precision master weights (`eval_fp/...`). Where:

- the synchronous loop scores the actor on its own rollout engine (SGLang servers, or the local
  engine it rolls out with): nothing new is loaded anywhere;
- the asynchronous controller holds no engine: it sends the evaluation requests to its rollout
  workers as generation tasks (qurl/pipeline/remote_eval.py), which answer with the engines they
  roll out with, at the version just published; on CPU and GPU alike (one path);
- the fp policy (eval.fp_policy) is always a local fp32 decoder in rank 0's process.

A local decoder on the learner's GPU takes the weights plus the KV cache of its largest batch
(LocalEngine: up to 256 rows, fp32 cache): Avg@32 at 8k tokens is ~120 GB at 1.5B, far beyond
what the learner leaves free. So on CUDA the fp policy's engine is checked at start against
deploy.eval_gpu_gb and refused in one line (`check_eval`) naming what it would take and what to
change; on CPU nothing is checked (host memory, the small CPU presets: `make run` is unchanged,
its fp policy included). `eval_placement` is the decision, pure and testable without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qurl.config import ConfigError, DeployConfig, EvalConfig, RolloutConfig

LOCAL_MAX_BATCH = 256  # rows a LocalEngine decodes at once (qurl/engines/local.py max_batch)
PROMPT_TOKENS = 512  # prompt tokens assumed in front of eval.max_new_tokens (as learner/memory_plan.py)
GB = 1e9


@dataclass(frozen=True)
class EvalPlacement:
    """actor: "rollout" (the sync loop's rollout engine) or "workers" (the async controller's
    rollout workers); fp: whether the full-precision policy is scored (a local decoder in rank 0's
    process); on_gpu: whether that decoder sits on the learner's GPU (then it is checked against
    deploy.eval_gpu_gb)."""
    actor: str
    fp: bool
    on_gpu: bool

    @property
    def local_engines(self) -> list[str]:
        """The local evaluation engines on rank 0: "fp" (fp32) or none; the actor never is one."""
        return ["fp"] if self.fp else []


def eval_placement(ecfg: EvalConfig, rollout: RolloutConfig, *, cuda: bool,
                   asynchronous: bool) -> EvalPlacement:
    """Which engine scores which policy (module docstring); rollout: for rollout.precision (a
    bf16 actor has no fp policy beside it)."""
    fp = ecfg.fp_policy and rollout.precision != "bf16"
    return EvalPlacement(actor="workers" if asynchronous else "rollout", fp=fp, on_gpu=cuda)


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


def check_eval(e: EvalConfig, deploy: DeployConfig, placement: EvalPlacement,
               fields: dict[str, Any] | None, n_problems: int) -> None:
    """Refuse, in one line, the fp policy's local engine on the learner's GPU when it is estimated
    over deploy.eval_gpu_gb. `fields`: the model's config.json fields (None: cannot estimate, so
    nothing is checked); n_problems: problems over all eval sets."""
    if not placement.on_gpu or fields is None or not placement.local_engines:
        return
    requests = n_problems * max(1 if e.greedy else 0, e.samples)
    rows = max(1, min(LOCAL_MAX_BATCH, requests))
    tokens = PROMPT_TOKENS + e.max_new_tokens
    try:
        need = local_eval_bytes(fields, rows=rows, tokens=tokens, weight_bytes=4.0)  # fp32
    except (KeyError, TypeError, ValueError):
        return  # a config.json without the usual shape fields: cannot estimate
    if need > deploy.eval_gpu_gb * GB:
        raise ConfigError(
            f"evaluation: the full-precision policy (eval.fp_policy) would take ~{need / GB:.1f} "
            f"GB on learner rank 0's GPU (a local decoder: weights + fp32 KV of {rows} rows x "
            f"{tokens} tokens) but deploy.eval_gpu_gb={deploy.eval_gpu_gb:g}: set "
            f"eval.fp_policy=false, lower eval.samples (now {e.samples}) or eval.max_new_tokens "
            f"(now {e.max_new_tokens}), or raise deploy.eval_gpu_gb")
