"""The config tree: what a run learns (eight training sections) and where it runs (`sglang`, `deploy`,
whose sections live in deployment.py; the bound markers and type aliases in fields.py).

Every field carries its type, its default and a docstring (the string under it, read by
`field_doc`). Choices are `Literal` types and bounds are `Annotated[..., Min(x)]` / `MoreThan(x)`,
so a field states its own rules and `qurl.config.load` checks them all from the types alone; the
few rules that tie two fields together live in `qurl.config.rules`. A section may hold a nested
table (`algo.correction`, written `[algo.correction]` in TOML, set as `algo.correction.cap=3`);
its leaves are fields like any other (and count as such among the training fields).

The training sections (run, model, data, rollout, algo, eval, optim, learner) decide the numbers
a run produces for a given seed. `sglang` and `deploy` decide only where the processes run, how
they find each other and what is written on the side: two runs that differ only there learn the
same policy (up to float summation order across a different process layout).
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cache
from typing import Annotated, Any, Iterator, Literal

from qurl.config.deployment import DeployConfig, SGLangConfig
from qurl.config.fields import Backend, Count, Min, MoreThan, Positive, PositiveFloat, Precision

__all__ = ["Backend", "Count", "Min", "MoreThan", "Positive", "PositiveFloat", "Precision",
           "DeployConfig", "SGLangConfig"]  # with the sections below, what `qurl.config` re-exports


@dataclass(frozen=True)
class RunConfig:
    name: str = "qurl-cpu-tiny"
    """The run's directory under deploy.dir: config.toml, metrics.jsonl, checkpoints/, logs/."""
    seed: Count = 0
    """Seeds the base model's warm start, the data order and every sampling request."""
    steps: Positive = 60
    """RL steps; each trains on prompts_per_step x group_size samples in algo.mini_batches updates."""
    eval_every: Count = 20
    """Evaluate every this many steps; 0 = only before the first step and after the last."""


@dataclass(frozen=True)
class ModelConfig:
    base: str = "tiny"
    """The policy RL starts from: `tiny` (3.4M), `small` (104M) or `tiny-qwen3` (3.7M), models
    built and warm-started here, or the path of a Hugging Face checkpoint directory (dense Qwen2,
    Qwen3 or Llama). `tiny-qwen3-moe` (6.85M, 8 experts, top-2) is built here too, and a Qwen3-MoE
    or Mixtral checkpoint trains as well (docs/moe.md)."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Learner compute: bfloat16 (fp32 master weights and AdamW moments) or float32. On a CPU with
    AVX512-BF16 a bf16 matmul is 2.6x an fp32 one: the tiny learner's step is 1.75x faster."""
    warmstart_steps: Count = 250
    """Supervised steps on worked solutions of the synthetic task before RL (RL needs a policy that
    is sometimes right; qurl/models/base.py); 0 = none. Applies to `tiny`/`small`, and to a
    checkpoint base only with warmstart_checkpoint."""
    warmstart_lr: PositiveFloat = 3e-3
    """Learning rate of that warm start (peak; warm-up, then cosine to a tenth)."""
    warmstart_checkpoint: bool = False
    """Warm-start a checkpoint base (a path or a fetched name) too, on data.train=synthetic; off,
    a checkpoint is RL's start as given. The result is cached and copied into the run dir."""


@dataclass(frozen=True)
class DataConfig:
    train: str = "synthetic"
    """Training prompts: `synthetic` arithmetic, or a jsonl/json/parquet file."""
    eval: str = "synthetic"
    """Evaluation sets, comma-separated: `synthetic`, shipped set names (qurl/data/sets/) or files."""
    format: Literal["auto", "gsm8k", "qa", "math", "deepscaler", "dapo", "minerva",
                    "olympiadbench", "custom"] = "auto"
    """Row layout of the files: which columns hold question and answer (`auto` guesses)."""
    fields: tuple[str, ...] = ()
    """`question,answer` column names; required by format=custom, overrides the format's."""
    template: Literal["plain", "boxed", "chat", "chat-1shot"] = "plain"
    """Prompt wrapping: the bare question, + an instruction to answer in \\boxed{}, the chat
    template, or the chat template after one worked example exchange (qurl/data/templates.py)."""
    digits: Positive = 1
    """Synthetic arithmetic: digits per operand."""
    operands: Positive = 3
    """Synthetic arithmetic: numbers per question."""
    train_size: Count = 2000
    """Training questions (synthetic: generated; files: the first N); 0 = all of a file."""
    eval_size: Count = 200
    """Evaluation questions per set (the first N); 0 = all."""


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["local", "sglang"] = "local"
    """Who generates: qurl's in-process engine, or SGLang servers (the product path)."""
    precision: Precision = "int8"
    """Rollout weights: bf16, int8 or fp8 per output channel, fp8_block (128x128 scales; SGLang
    only), or w4a16 (int4 weight-only, groups of 128; local engine only: the ablation study's
    declared stress format)."""
    group_size: Positive = 8
    """G: samples per prompt; GRPO's advantage is each reward against its group's."""
    prompts_per_step: Positive = 16
    """Prompts per RL step: the batch is prompts_per_step x group_size samples."""
    max_new_tokens: Positive = 32
    """Response length limit of a rollout sample."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature of rollout."""
    top_p: Annotated[float, MoreThan(0)] = 1.0
    """Nucleus sampling of rollout, in (0, 1]."""
    max_staleness: Count = 0
    """η: a batch may come from weights at most this many updates old (async rollout); 0 =
    on-policy, the batch of step t generated by the weights after step t-1."""


@dataclass(frozen=True)
class CorrectionConfig:
    """The importance weight's settings (`[algo.correction]`; equations in qurl/algo/corrections.py).

    One table for every correction algo.loss can name: each leaf says which losses read it.
    `bounds` and `keep` left at their defaults take the named kind's usual setting, so one leaf
    serves IcePop and the geometric mask without a pair of fields each."""
    cap: Annotated[float, Min(1)] = 2.0
    """C, the largest importance weight: tis and acr truncate ρ = π_prox/π_behav at C, mis masks
    the tokens with ρ > C, seqtis truncates the sequence's ∏_t ρ_t at C (verl 2, TRL 3, SkyRL 5).
    The cut/tis, cut/mis and cut/seqtis diagnostics use it whatever the loss."""
    bounds: tuple[float, ...] = ()
    """[low, high], inclusive, 0 < low <= 1 <= high: icepop masks the tokens whose ρ is outside,
    geomask the sequences whose g = exp(mean log ρ over their tokens) is outside; [] = the kind's
    usual bounds (icepop [0.5, 5]: Ring-1T, verl; geomask [0.99, 1.01]: SkyRL). Read by icepop and
    geomask only; the cut/icepop and cut/geomask diagnostics of a run use the loss's own kind's
    bounds from here and the usual bounds for every other kind."""
    keep: Literal["auto", "rho", "one", "geo"] = "auto"
    """Weight of what icepop or geomask keeps: rho = ρ per token, one = 1, geo = g per sequence
    (geomask only); auto = the kind's usual choice, ρ for icepop (verl, NeMo-RL, slime, AReaL;
    SkyRL uses 1) and 1 for geomask (SkyRL, verl; NeMo-RL uses ρ, AReaL and slime g). Read by
    icepop and geomask only."""


@dataclass(frozen=True)
class AlgoConfig:
    loss: Literal["ppo", "naive", "decoupled", "tis", "acr", "icepop", "mis", "seqtis",
                  "geomask"] = "acr"
    """Policy loss (DESIGN.md; equations in qurl/algo/loss.py and qurl/algo/corrections.py): ppo
    (ratio to the learner's own pre-update policy, no IS weight), naive (ratio to the engine's
    behaviour policy), decoupled, tis (truncated IS weight, cap C), acr (decoupled with the
    Adaptive Clipping Range); decoupled PPO with the field's other weights: icepop (ρ masked
    outside correction.bounds), mis (ρ > C masked), seqtis (min(∏ρ, C) on the whole sequence),
    geomask (sequence masked when exp(mean log ρ) is outside correction.bounds); C is
    correction.cap."""
    clip: tuple[float, ...] = (0.2, 0.2)
    """(ε_low, ε_high): the ratio is clipped to [1 − ε_low, 1 + ε_high], each ε > 0 (DAPO's
    clip-higher raises ε_high, e.g. 0.2,0.28)."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """The importance weight's cap, bounds and kept weight (the [algo.correction] table)."""
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """Loss aggregation over tokens; seq-mean-token-sum-norm is Dr.GRPO's constant normaliser
    (rollout.max_new_tokens)."""
    advantage: Literal["grpo", "drgrpo"] = "grpo"
    """grpo: (r - mean) / std within the group; drgrpo: r - mean."""
    kl_coef: Annotated[float, Min(0)] = 0.0
    """Weight of the k3 KL to the initial policy; 0 = off."""
    mini_batches: Positive = 2
    """Optimizer updates per step (>= 2, so clipping and ACR can bind)."""
    epochs: Positive = 1
    """Passes over the batch per step."""
    dynamic_sampling_rounds: Count = 0
    """DAPO dynamic sampling: drop groups whose accuracies are all equal and sample more prompts
    until the batch holds prompts_per_step groups, in at most this many rollout rounds per step
    (then the step fails; qurl/train/dynamic_sampling.py); 0 = off, every group is trained on."""
    overlong: tuple[float, ...] = (0.0, 1.0)
    """DAPO soft overlong penalty, (window, penalty): a response's reward falls linearly by up to
    `penalty` over the last `window` tokens before rollout.max_new_tokens; window a whole number
    of tokens, 0 = off; penalty >= 0."""
    uaq_scale: PositiveFloat = 1.5
    """s of update-aware invariant scaling (UAQ); 1.0 = off."""
    routing_replay: Literal["off", "rollout"] = "off"
    """Mixture-of-experts only (refused for a dense model): rollout = the learner's MoE layers use
    the experts the rollout engine chose for every token (π_prox, training forwards, recompute;
    the router still learns through the gathered scores; qurl/learner/replay.py); off = the
    learner routes by itself. The moe/ route-flip metrics are reported either way."""


@dataclass(frozen=True)
class EvalConfig:
    greedy: bool = True
    """Accuracy of the temperature-0 answer."""
    samples: Count = 0
    """k of Avg@k: samples per problem at `temperature`; 0 = no sampled evaluation."""
    pass_k: tuple[int, ...] = ()
    """pass@k values reported from those samples (unbiased estimator; each k <= samples)."""
    temperature: Annotated[float, Min(0)] = 0.6
    """Sampling temperature of the sampled evaluation."""
    top_p: Annotated[float, MoreThan(0)] = 1.0
    """Nucleus sampling of the sampled evaluation, in (0, 1]."""
    max_new_tokens: Positive = 32
    """Response length limit of an evaluation answer."""
    fp_policy: bool = True
    """Also score the full-precision policy (the master weights in an unquantized local engine)
    beside the rollout engine, and their difference (eval_gap/...); skipped for bf16 rollout.
    An fp32 decoder in learner rank 0's process: runs as is on CPU; on a GPU opt-in (off in the GPU
    presets) and bounded (refused at start over deploy.eval_gpu_gb). The actor is scored on the
    rollout engines (async: the workers')."""


@dataclass(frozen=True)
class OptimConfig:
    lr: PositiveFloat = 3e-5
    """AdamW learning rate."""
    weight_decay: Annotated[float, Min(0)] = 0.0
    """AdamW decoupled weight decay."""
    adam: tuple[float, ...] = (0.9, 0.999, 1e-8)
    """AdamW (β1, β2, ε): the moments' decay rates, each in [0, 1), and the denominator's ε > 0."""
    grad_clip: Annotated[float, Min(0)] = 1.0
    """Global gradient-norm clip; 0 = off."""
    warmup_steps: Count = 0
    """Linear learning-rate warmup, in optimizer updates."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warmup."""


@dataclass(frozen=True)
class LearnerConfig:
    tp: Positive = 1
    """Tensor-parallel size of the Megatron learner."""
    dp: Positive = 1
    """Data-parallel size; the learner has tp x dp ranks."""
    ep: Positive = 1
    """Expert-parallel size (a mixture of experts only): the experts of every layer are divided
    over groups of ep data-parallel ranks, each rank holding E/ep of them (megatron-core's
    expert_model_parallel_size; docs/moe.md). Must divide learner.dp and the model's expert count."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute (megatron-core's own): none = keep every layer's activations for the
    backward; selective = recompute each layer's core attention and MLP; full = keep only each
    layer's input and rerun the layer in the backward (~1/3 more compute, the least memory). Same
    gradients either way; `qurl launch --dry-run` prints what each choice needs."""


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)


TRAINING_SECTIONS = ("run", "model", "data", "rollout", "algo", "eval", "optim", "learner")
DEPLOYMENT_SECTIONS = ("sglang", "deploy")
LOCAL_BASES = ("tiny", "small", "tiny-qwen3", "tiny-qwen3-moe")  # model.base values built here rather than read from a path


@cache
def field_doc(section_cls: type, name: str) -> str:
    """The docstring written under field `name` of a config section class ('' when missing)."""
    tree = ast.parse(inspect.getsource(section_cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and stmt.target.id == name and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            return inspect.cleandoc(nxt.value.value)
    return ""


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, type, str, Any]]:
    """Every leaf field of a config object, in declaration order: (dotted name, the class that
    declares it, its name there, its value). A nested table (a dataclass-valued field such as
    algo.correction) is walked into, never yielded itself. `prefix` goes before each name
    (e.g. "algo.")."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", type(obj), f.name, value
