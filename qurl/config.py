"""The one config tree of qurl: frozen dataclasses, presets as Python functions, TOML + `--set` overrides.

(Over the ~400-line norm for now: the tree, its validation and the presets share one file until
the config redesign of issue 14 splits deployment settings and per-field choices out.)

A run is fully described by a `Config`. It is built from a preset (`cpu-tiny` by default), then a
TOML file (`--config f.toml`, same section names as the dataclasses), then `--set a.b=c` overrides,
and validated once (`validate`) with errors that name the field. The resolved tree is written to the
run directory as `config.toml` and read back on resume, where fields in `IMMUTABLE_ON_RESUME` must
not change.
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, get_args, get_origin, get_type_hints

from qurl.errors import InputError


@dataclass(frozen=True)
class RunConfig:
    name: str = "qurl-cpu-tiny"
    dir: str = "runs"
    seed: int = 0
    steps: int = 60
    eval_every: int = 20  # steps; 0 = only before and after
    ckpt_every: int = 20  # steps; 0 = only at the end
    keep_ckpts: int = 2
    wandb: bool = False
    wandb_mode: str = "offline"  # offline | online | disabled
    progress: bool = True
    # torch CPU threads per process; 0 = auto: the node's cores shared by the processes computing
    # at once (qurl.setup.set_threads; OpenMP threads sharing a core spin in barriers: 25x slower)
    torch_threads: int = 0


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"  # tiny | small | path (then `path` names an HF checkpoint dir)
    path: str = ""  # HF checkpoint dir; for tiny/small: where the locally built model is cached
    # learner: bfloat16 (bf16 compute, fp32 masters + AdamW moments) | float32. With AVX512-BF16
    dtype: str = "bfloat16"  # a CPU bf16 matmul is 2.6x fp32's: the tiny learner step 1.75x faster
    warmstart_steps: int = 250  # SFT steps on worked solutions before RL (tiny/small only); 0 = none
    warmstart_lr: float = 3e-3


@dataclass(frozen=True)
class DataConfig:
    train: str = "synthetic"  # synthetic | path to jsonl/parquet
    eval: str = "synthetic"
    format: str = "auto"  # auto | gsm8k | math | deepscaler | dapo | minerva | olympiadbench | custom
    question_field: str = ""
    answer_field: str = ""
    template: str = "plain"  # plain | boxed | chat
    digits: int = 1  # synthetic arithmetic difficulty: digits per operand
    operands: int = 3  # synthetic arithmetic: numbers per question
    train_size: int = 2000
    eval_size: int = 200
    reward_timeout_s: float = 5.0


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "local"  # local | sglang
    # bf16 | int8 | fp8 (per channel) | fp8_block (128x128; sglang only) | w4a16 (int4
    # weight-only, groups of 128; local engine only: the ablation study's declared stress format)
    precision: str = "int8"
    group_size: int = 8  # G samples per prompt
    prompts_per_step: int = 16
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    eval_max_new_tokens: int = 32
    num_workers: int = 1
    max_staleness: int = 0  # η; 0 = synchronous
    mode: str = "sync"  # sync | async
    # async: "local" = the controller starts and restarts its num_workers worker processes;
    # "external" = they are started elsewhere (`python -m qurl.pipeline.worker --run-dir ... --slot i`,
    # other machines reaching stream.host) and the controller waits for them to connect
    workers: str = "local"
    sglang_urls: tuple[str, ...] = ()  # attach to running servers; empty = launch
    sglang_args: tuple[str, ...] = ()  # extra flags passed to sglang.launch_server
    sglang_tp: int = 1


@dataclass(frozen=True)
class AlgoConfig:
    loss: str = "acr"  # ppo | naive | decoupled | tis | acr
    eps_low: float = 0.2
    eps_high: float = 0.2
    tis_cap: float = 2.0  # C
    agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    advantage: str = "grpo"  # grpo | drgrpo
    kl_coef: float = 0.0  # k3 KL to the initial policy; 0 = off
    mini_batches: int = 2  # >=2 so clipping (and ACR) can bind
    epochs: int = 1
    # DAPO: drop groups whose accuracies are all equal and sample more prompts until the batch
    # holds prompts_per_step groups (qurl/dynamic_sampling.py), at most max_sample_rounds rollouts
    dynamic_sampling: bool = False
    max_sample_rounds: int = 16
    overlong_buffer: int = 0  # DAPO soft overlong penalty window in tokens; 0 = off
    overlong_penalty: float = 1.0
    uaq_scale: float = 1.5  # s; 1.0 = UAQ off


@dataclass(frozen=True)
class EvalConfig:
    """What an evaluation measures on every set of data.eval (qurl/evaluation/)."""
    greedy: bool = True  # accuracy of the temperature-0 answer
    samples: int = 0  # k of Avg@k: samples per problem at `temperature`; 0 = no sampled eval
    pass_k: tuple[int, ...] = ()  # pass@k reported from those samples (unbiased; each <= samples)
    temperature: float = 0.6
    top_p: float = 1.0
    # also score the full-precision policy (master weights in an unquantized local engine) side by
    # side with the rollout engine, and their difference (eval_gap/...); skipped for bf16 rollout
    fp_policy: bool = True


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine


@dataclass(frozen=True)
class LearnerConfig:
    tp: int = 1  # tensor-parallel size
    dp: int = 1  # data-parallel size; the learner has tp * dp ranks
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | gloo | nccl
    nnodes: int = 1
    nproc_per_node: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    distributed_optimizer: bool = False  # shard fp32 masters + AdamW moments over DP (ZeRO-1)
    # Transformer Engine layers (CUDA only): auto = when transformer_engine imports and CUDA is
    # present, else megatron's local spec; on = required; off = local spec
    transformer_engine: str = "auto"


@dataclass(frozen=True)
class StreamConfig:
    host: str = "127.0.0.1"  # address the learner binds/advertises
    # the controller's inbox (trajectories + worker control); 0 = random free port. Workers bind
    # their own prompt inbox and announce it in their (authenticated) hello.
    traj_port: int = 0
    hwm: int = 1000
    key: str = ""  # shared HMAC key; empty = random per run (stored in the run dir)


@dataclass(frozen=True)
class SyncConfig:
    bucket_mb: float = 64.0
    port: int = 0  # weight-broadcast rendezvous port; 0 = random
    # async controller -> workers: gloo (CPU tensors; right for SGLang workers, which forward to
    # their servers themselves) or nccl (each worker on a GPU of its own, with a local engine)
    backend: str = "gloo"


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
    stream: StreamConfig = field(default_factory=StreamConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)


# Fields a resumed run may not change: they define the weights and their layout.
IMMUTABLE_ON_RESUME = (
    "model.preset", "model.path", "model.dtype", "learner.tp", "algo.uaq_scale",
    "rollout.group_size", "run.seed", "data.train", "learner.dp", "learner.distributed_optimizer",
)

_CHOICES = {
    "model.preset": ("tiny", "small", "path"),
    "model.dtype": ("float32", "bfloat16"),
    "data.format": ("auto", "gsm8k", "math", "deepscaler", "dapo", "minerva", "olympiadbench",
                    "custom"),
    "data.template": ("plain", "boxed", "chat"),
    "rollout.engine": ("local", "sglang"),
    "rollout.precision": ("bf16", "int8", "fp8", "fp8_block", "w4a16"),
    "rollout.mode": ("sync", "async"),
    "rollout.workers": ("local", "external"),
    "algo.loss": ("ppo", "naive", "decoupled", "tis", "acr"),
    "algo.agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "algo.advantage": ("grpo", "drgrpo"),
    "optim.schedule": ("constant", "cosine"),
    "learner.backend": ("auto", "gloo", "nccl"),
    "learner.transformer_engine": ("auto", "on", "off"),
    "sync.backend": ("gloo", "nccl"),
    "run.wandb_mode": ("offline", "online", "disabled"),
}
_POSITIVE = (
    "rollout.group_size", "rollout.prompts_per_step", "rollout.max_new_tokens", "rollout.num_workers",
    "algo.eps_low", "algo.eps_high", "algo.mini_batches", "algo.epochs", "optim.lr", "learner.tp",
    "learner.dp", "rollout.temperature", "algo.uaq_scale", "sync.bucket_mb", "run.steps",
    "algo.max_sample_rounds",
)


class ConfigError(InputError):
    """A config value is wrong; the message names the field."""


def get_field(cfg: Config, dotted: str) -> Any:
    section, _, name = dotted.partition(".")
    return getattr(getattr(cfg, section), name)


def validate(cfg: Config) -> Config:
    for key, choices in _CHOICES.items():
        if get_field(cfg, key) not in choices:
            raise ConfigError(f"{key}={get_field(cfg, key)!r}: must be one of {', '.join(choices)}")
    for key in _POSITIVE:
        if not get_field(cfg, key) > 0:
            raise ConfigError(f"{key}={get_field(cfg, key)!r}: must be > 0")
    if cfg.algo.tis_cap < 1:
        raise ConfigError(f"algo.tis_cap={cfg.algo.tis_cap}: must be >= 1")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p}: must be in (0, 1]")
    for key in ("rollout.max_staleness", "run.torch_threads"):
        if get_field(cfg, key) < 0:
            raise ConfigError(f"{key}={get_field(cfg, key)}: must be >= 0")
    # The batch always holds prompts_per_step full groups (dynamic sampling refills it), so these
    # two checks keep every step divisible into mini-batches x data-parallel ranks.
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if batch % cfg.algo.mini_batches:
        raise ConfigError(
            f"algo.mini_batches={cfg.algo.mini_batches}: must divide prompts_per_step*group_size={batch}")
    if (batch // cfg.algo.mini_batches) % cfg.learner.dp:
        raise ConfigError(f"learner.dp={cfg.learner.dp}: must divide the mini-batch of "
                          f"{batch // cfg.algo.mini_batches} sequences (prompts_per_step*group_size"
                          f"/algo.mini_batches)")
    if cfg.rollout.precision == "w4a16" and cfg.rollout.engine != "local":
        raise ConfigError("rollout.precision='w4a16': the weight-only 4-bit stress format of the "
                          "ablation study runs on the local engine only (rollout.engine='local')")
    e = cfg.eval
    if e.samples < 0:
        raise ConfigError(f"eval.samples={e.samples}: must be >= 0")
    if not e.greedy and not e.samples:
        raise ConfigError("eval.greedy=false and eval.samples=0: the evaluation would measure nothing")
    for k in e.pass_k:
        if not 1 <= k <= e.samples:
            raise ConfigError(f"eval.pass_k={list(e.pass_k)}: each k must be in [1, eval.samples="
                              f"{e.samples}]")
    if e.samples and not e.temperature > 0:
        raise ConfigError(f"eval.temperature={e.temperature}: must be > 0 for sampled evaluation")
    if not 0 < e.top_p <= 1:
        raise ConfigError(f"eval.top_p={e.top_p}: must be in (0, 1]")
    if cfg.rollout.precision == "fp8_block" and cfg.rollout.engine != "sglang":
        raise ConfigError("rollout.precision='fp8_block': SGLang's block-scaled FP8 needs "
                          "rollout.engine='sglang' (the local engine runs int8/fp8 per channel)")
    if cfg.model.preset == "path" and not cfg.model.path:
        raise ConfigError("model.path: required when model.preset='path'")
    return cfg


# ---------------------------------------------------------------- overrides, TOML, dumping

def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Turn a TOML value or a `--set` string into the field's declared type."""
    origin = get_origin(typ)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        return tuple(_coerce(v, get_args(typ)[0], key) for v in value)
    if not isinstance(value, str):
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
            return value
        raise ConfigError(f"{key}={value!r}: expected {typ.__name__}")
    try:
        if typ is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return typ(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r}: expected {typ.__name__}") from None


def override(cfg: Config, updates: dict[str, Any]) -> Config:
    """Apply {"section.field": value} updates; unknown sections/fields are errors."""
    sections = {f.name: f for f in fields(cfg)}
    new_sections: dict[str, Any] = {}
    for key, value in updates.items():
        section, dot, name = key.partition(".")
        if not dot or section not in sections:
            raise ConfigError(f"{key}: unknown config section (known: {', '.join(sections)})")
        current = new_sections.get(section, getattr(cfg, section))
        hints = get_type_hints(type(current))
        if name not in hints:
            raise ConfigError(f"{key}: unknown field of [{section}] (known: {', '.join(hints)})")
        new_sections[section] = replace(current, **{name: _coerce(value, hints[name], key)})
    return replace(cfg, **new_sections)


def parse_sets(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(f"--set {pair!r}: expected section.field=value")
        out[key.strip()] = value.strip()
    return out


def from_toml(cfg: Config, path: str | Path) -> Config:
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    flat = {}
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
        flat.update({f"{section}.{k}": v for k, v in values.items()})
    return override(cfg, flat)


def to_toml(cfg: Config) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, tuple):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    lines = []
    for section in fields(cfg):
        lines.append(f"[{section.name}]")
        for k, v in dataclasses.asdict(getattr(cfg, section.name)).items():
            lines.append(f"{k} = {fmt(tuple(v) if isinstance(v, list) else v)}")
        lines.append("")
    return "\n".join(lines)


def immutable_changes(old: Config, new: Config) -> list[str]:
    return [f"{k}: {get_field(old, k)!r} -> {get_field(new, k)!r}"
            for k in IMMUTABLE_ON_RESUME if get_field(old, k) != get_field(new, k)]


# ---------------------------------------------------------------- presets

def cpu_tiny() -> Config:
    """The embedded default: INT8 rollout + ACR + UAQ on a tiny Qwen2 learning synthetic arithmetic.

    One-digit, three-operand sums/differences ("7-3+5="): 250 SFT steps put the tiny model near 50%
    greedy accuracy — right often enough that most groups of 8 carry both rewards — and 60 RL
    steps at lr 3e-5 (16 prompts x 8 samples, 2 mini-batches) fit in a few CPU minutes."""
    return Config()


def paper_ppo_gsm8k() -> Config:
    """Paper Table: PPO on GSM8K, Qwen2.5-0.5B-Instruct, lr 1e-5, no UAQ (updates are already large)."""
    return override(Config(), {
        "run.name": "paper-ppo-gsm8k", "run.steps": 500, "run.eval_every": 50, "run.ckpt_every": 50,
        "model.preset": "path", "model.path": "Qwen/Qwen2.5-0.5B-Instruct", "model.dtype": "bfloat16",
        "model.warmstart_steps": 0,
        "data.train": "data/gsm8k_train.parquet", "data.eval": "gsm8k_test", "data.format": "gsm8k", "data.eval_size": 0,
        "data.template": "chat",
        "rollout.engine": "sglang", "rollout.group_size": 8, "rollout.prompts_per_step": 64,
        "rollout.max_new_tokens": 512, "rollout.eval_max_new_tokens": 512,
        "algo.mini_batches": 4, "algo.uaq_scale": 1.0, "optim.lr": 1e-5,
        "learner.tp": 1,
    })


def paper_deepscaler_1p5b() -> Config:
    """Paper: GRPO on DeepScaleR-Preview, DeepSeek-R1-Distill-Qwen-1.5B, lr 1e-6, UAQ s=1.5,
    k3 KL 1e-3, 8 samples per prompt, 8k context; INT8 rollout + ACR (C=2)."""
    return override(Config(), {
        "run.name": "paper-deepscaler-1.5b", "run.steps": 1200, "run.eval_every": 50,
        "run.ckpt_every": 50,
        "model.preset": "path", "model.path": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        "model.dtype": "bfloat16", "model.warmstart_steps": 0,
        "data.train": "data/deepscaler.json",
        "data.eval": "aime24,amc23,math500,minerva_math,olympiadbench", "data.format": "deepscaler", "data.eval_size": 0,
        "eval.greedy": False, "eval.samples": 32, "eval.pass_k": (8, 32), "eval.temperature": 0.6,
        "eval.top_p": 0.95,
        "data.template": "chat",
        "rollout.engine": "sglang", "rollout.precision": "int8", "rollout.group_size": 8,
        "rollout.prompts_per_step": 128, "rollout.max_new_tokens": 8192,
        "rollout.eval_max_new_tokens": 8192, "rollout.temperature": 0.6,
        "algo.loss": "acr", "algo.advantage": "grpo", "algo.agg": "token-mean", "algo.kl_coef": 1e-3,
        "algo.mini_batches": 4, "algo.uaq_scale": 1.5, "algo.tis_cap": 2.0,
        "optim.lr": 1e-6, "optim.weight_decay": 0.01, "learner.tp": 2,
    })


def paper_dapo_7b() -> Config:
    """Paper: DAPO on DAPO-Math-17k, Qwen2.5-Math-7B, lr 1e-6, UAQ s=1.5, clip-higher 0.2/0.28,
    dynamic sampling, token-mean loss, overlong shaping, 16 samples x 512 prompts, no KL."""
    return override(Config(), {
        "run.name": "paper-dapo-7b", "run.steps": 1200, "run.eval_every": 50, "run.ckpt_every": 50,
        "model.preset": "path", "model.path": "Qwen/Qwen2.5-Math-7B", "model.dtype": "bfloat16",
        "model.warmstart_steps": 0,
        "data.train": "data/dapo-math-17k.parquet", "data.eval": "aime24", "data.format": "dapo", "data.eval_size": 0,
        "eval.greedy": True, "eval.samples": 32, "eval.pass_k": (8, 32), "eval.temperature": 1.0,
        "eval.top_p": 0.7,
        "data.template": "chat",
        "rollout.engine": "sglang", "rollout.precision": "int8", "rollout.group_size": 16,
        "rollout.prompts_per_step": 512, "rollout.max_new_tokens": 20480,
        "rollout.eval_max_new_tokens": 20480, "rollout.sglang_tp": 2,
        "algo.loss": "acr", "algo.eps_low": 0.2, "algo.eps_high": 0.28, "algo.agg": "token-mean",
        "algo.dynamic_sampling": True, "algo.overlong_buffer": 4096, "algo.mini_batches": 16,
        "algo.uaq_scale": 1.5, "optim.lr": 1e-6, "optim.weight_decay": 0.1, "optim.warmup_steps": 10,
        "learner.tp": 4,
    })


PRESETS: dict[str, Callable[[], Config]] = {
    "cpu-tiny": cpu_tiny,
    "paper-ppo-gsm8k": paper_ppo_gsm8k,
    "paper-deepscaler-1.5b": paper_deepscaler_1p5b,
    "paper-dapo-7b": paper_dapo_7b,
}


def load_config(preset: str = "cpu-tiny", toml: str | Path | None = None,
                sets: list[str] | None = None) -> Config:
    """Preset -> TOML file -> `--set` overrides -> validate."""
    if preset not in PRESETS:
        raise ConfigError(f"preset {preset!r}: unknown (known: {', '.join(PRESETS)})")
    cfg = PRESETS[preset]()
    if toml is not None:
        cfg = from_toml(cfg, toml)
    if sets:
        cfg = override(cfg, parse_sets(sets))
    return validate(cfg)
