"""The config tree: what a run learns (eight training sections) and where it runs (`sglang`, `deploy`).

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


@dataclass(frozen=True)
class Min:
    """Bound a numeric field from below, inclusive: `Annotated[int, Min(1)]` means >= 1."""
    value: float


@dataclass(frozen=True)
class MoreThan:
    """Bound a numeric field from below, exclusive: `Annotated[float, MoreThan(0)]` means > 0."""
    value: float


Positive = Annotated[int, Min(1)]
Count = Annotated[int, Min(0)]
PositiveFloat = Annotated[float, MoreThan(0)]
Precision = Literal["bf16", "int8", "fp8", "fp8_block", "w4a16"]
Backend = Literal["auto", "gloo", "nccl"]


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
    Qwen3 or Llama)."""
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
    (then the step fails; qurl/rollout/dynamic_sampling.py); 0 = off, every group is trained on."""
    overlong: tuple[float, ...] = (0.0, 1.0)
    """DAPO soft overlong penalty, (window, penalty): a response's reward falls linearly by up to
    `penalty` over the last `window` tokens before rollout.max_new_tokens; window a whole number
    of tokens, 0 = off; penalty >= 0."""
    uaq_scale: PositiveFloat = 1.5
    """s of update-aware invariant scaling (UAQ); 1.0 = off."""


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
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute (megatron-core's own): none = keep every layer's activations for the
    backward; selective = recompute each layer's core attention and MLP; full = keep only each
    layer's input and rerun the layer in the backward (~1/3 more compute, the least memory). Same
    gradients either way; `qurl launch --dry-run` prints what each choice needs."""


@dataclass(frozen=True)
class SGLangConfig:
    """The SGLang engine's own settings (qurl/engines/sglang/engine.py takes only this section)."""
    urls: tuple[str, ...] = ()
    """Attach to these running servers; empty = launch deploy.engines servers locally."""
    args: tuple[str, ...] = ()
    """Extra flags for `python -m sglang.launch_server`."""
    tp: Positive = 1
    """Tensor-parallel size of each server (launched, or attached: checked against the server's
    /server_info when it is attached)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Learner -> servers weight-update group: auto = nccl when the learner has a GPU, else gloo;
    gloo moves the bytes through host memory (a one-GPU or colocated setup, where NCCL refuses
    two ranks on one GPU); nccl needs every member on a GPU of its own."""
    max_running: Count = 0
    """Rollout requests sent to EACH server at once; 0 = as many as the server runs at once, read
    from its /server_info (SGLang's effective max_running_requests, which it sizes from its KV
    pool; 256 for a server that reports none). A deployment setting: the samples are the same."""
    stall_s: Annotated[float, Min(0)] = 120.0
    """A server with requests in flight whose scheduler sends no output for this long (its
    /health_generate probes get none; /model_info would still answer) is stalled: its requests are
    cut and resubmitted, and it is restarted (launched by qurl) or dropped (attached; the last one
    stops the run with a one-line error). 0 = no watchdog (qurl/engines/sglang/watchdog.py)."""


@dataclass(frozen=True)
class DeployConfig:
    """Where a run executes, how its processes meet, and what it writes on the side."""
    # ---- files and logs
    dir: str = "runs"
    """Root of run directories (runs/<run.name>/) and of the built-base-model cache (runs/_base/)."""
    ckpt_every: Count = 20
    """Checkpoint every this many steps; 0 = only at the end."""
    keep_ckpts: Positive = 2
    """Checkpoints kept on disk (the newest)."""
    progress: bool = True
    """A progress bar on stderr."""
    wandb: Literal["off", "offline", "online"] = "off"
    """Also log metrics to Weights & Biases."""
    # ---- processes
    rollout: Literal["inline", "workers", "external"] = "inline"
    """Where rollout runs: inline = learner rank 0 drives the engines between steps (synchronous,
    needs rollout.max_staleness=0); workers = the controller starts one worker process per engine,
    streaming over ZeroMQ, and restarts them; external = such workers started elsewhere
    (`python -m qurl.pipeline.worker --run-dir ... --slot i`) connect to deploy.host."""
    engines: Positive = 1
    """Rollout engines: SGLang servers (inline) or worker processes, one engine each."""
    torch_threads: Count = 0
    """torch CPU threads per process; 0 = the node's cores shared by the processes computing at
    once (qurl/node/placement.py; OpenMP threads sharing a core spin in barriers: 25x slower)."""
    reward_timeout_s: PositiveFloat = 5.0
    """Time limit of scoring one answer (math verification can hang on adversarial output)."""
    # ---- learner ranks
    nnodes: Positive = 1
    """Learner nodes."""
    nproc_per_node: Count = 0
    """Learner ranks per node; 0 = learner.tp x learner.dp / nnodes."""
    backend: Backend = "auto"
    """The learner's torch.distributed backend: auto = nccl with CUDA, else gloo."""
    distributed_optimizer: bool = False
    """Shard fp32 master weights and AdamW moments over data-parallel ranks (ZeRO-1)."""
    transformer_engine: Literal["auto", "on", "off"] = "auto"
    """Transformer Engine layers (CUDA only): auto = when it imports and CUDA is present."""
    attention: Literal["sdpa", "unfused"] = "sdpa"
    """The learner's core attention without Transformer Engine: sdpa = torch's fused
    scaled-dot-product attention (flash / memory-efficient kernels; memory linear in the length);
    unfused = megatron's DotProductAttention, which keeps [heads, L, L] scores (the reference)."""
    wait_timeout_min: PositiveFloat = 1440.0
    """Minutes a learner rank waits for rank 0 at a control point (the next batch while rank 0
    generates and evaluates, the base model it prepares, checkpoints). These waits go through a
    gloo side group with this timeout, so NCCL's 30-minute watchdog never sees them."""
    eval_gpu_gb: Annotated[float, Min(0)] = 8.0
    """GB the fp policy's local engine (eval.fp_policy; weights + fp32 KV cache of its largest
    batch) may take on learner rank 0's GPU; the actor is scored on the rollout engines and takes
    none. An evaluation estimated over it is refused at start in one line
    (qurl/evaluation/placement.py); 0 = no local evaluation on the GPU. Not checked on CPU."""
    # ---- addresses
    host: str = "127.0.0.1"
    """Node 0's address as the others reach it: the learner's rendezvous, the controller's
    ZeroMQ inbox and every weight-broadcast group."""
    learner_port: Positive = 29500
    """The learner ranks' torch.distributed rendezvous port."""
    inbox_port: Count = 0
    """The controller's ZeroMQ inbox (trajectories, worker control); 0 = a free port."""
    weight_port: Count = 0
    """Rendezvous port of the weight-broadcast group; 0 = a free port."""
    # ---- the wire
    stream_hwm: Positive = 1000
    """ZeroMQ high-water mark: messages queued per socket before senders wait."""
    stream_key: str = ""
    """Shared HMAC key of the stream (>= 16 bytes); empty = random per run, kept in the run dir."""
    bucket_mb: PositiveFloat = 64.0
    """Weight-broadcast bucket size in MiB."""
    sync_mode: Literal["delta", "full"] = "delta"
    """Weight sync after each step: delta = only the 8-bit codes, scales and pass-through values
    whose bits changed since the version the engines hold (whole tensors where that is smaller;
    everything when an engine does not hold the previous version exactly); full = every tensor,
    every time. Both are verified by digests at every sync (docs/delta_sync.md)."""
    full_sync_every: Count = 0
    """With sync_mode = delta: every this many syncs one is full anyway; 0 = only when needed."""
    verify_kernels_every: Count = 10
    """SGLang servers: after every full sync and every this many delta syncs, read back what the
    kernels read, after SGLang's closing repack (the transposed W8A8 weights, every copy of a tied
    head), against the learner's digests: one more short update session and hash pass per server
    (qurl/engines/sglang/inside/kernels.py); a difference is a verification mismatch. 0 = never."""
    worker_backend: Literal["gloo", "nccl"] = "gloo"
    """Controller -> workers weight group: gloo (CPU tensors; right for SGLang workers, which
    forward to their servers) or nccl (each worker on a GPU of its own with a local engine)."""
    # ---- checks
    alarm_kl_factor: Annotated[float, Min(0)] = 10.0
    """Mismatch alarm (qurl/train/alarm.py): raised when KL(behav||prox) (`kl_behav_prox`) is
    above this many times its running median for deploy.alarm_steps steps in a row, as when the
    engine samples from other weights than the learner's through a fault the sync's digests
    cannot see (a quantizer bug). Recorded as `alarm/*` keys and printed once; 0 = off (else
    > 1). A deployment check: it changes no training math."""
    alarm_steps: Positive = 3
    """Steps in a row above the factor before the mismatch alarm fires."""
    alarm_stop: bool = False
    """Stop the run when the mismatch alarm fires: one error line (exit 2), resumable from the
    last checkpoint (qurl train --resume)."""


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
LOCAL_BASES = ("tiny", "small", "tiny-qwen3")  # model.base values built here rather than read from a path


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
