"""The deployment sections of the config tree: `sglang` and `deploy`.

They decide only where a run's processes execute, how they find each other and what is written
on the side, never the numbers a run produces for a seed (tree.py holds the training
sections and the whole `Config`). Every field carries its type, its default and a docstring
under it, as in tree.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from qurl.config.fields import Backend, Count, Min, Positive, PositiveFloat


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
    top_logprobs: Count = 0
    """Ask each server for the k most likely tokens at every sampled position (SGLang's
    `top_logprobs_num`) and record the behaviour policy's entropy from them (`behav_entropy`, a
    lower bound: the top k's terms plus the rest of the mass as one token); 0 = not asked, and
    SGLang runs record no engine entropy. The local engine always records the exact one. A
    reporting setting: the samples are the same, the replies k times larger."""
    return_routes: bool = False
    """A mixture of experts: ask the servers for the experts they routed each token to even with
    algo.routing_replay=off, so the learner measures how often its own top-k differs from theirs
    (moe/route_flip_frac and the rest of qurl/algo/routes.py); replay on always asks. Launched
    servers get `--enable-return-routed-experts`, attached ones must run with it. A reporting
    setting: the samples are the same, each reply carries k expert ids per token and layer. On a
    CPU-only torch that flag stops SGLang 0.5.23 at start (docs/moe.md, "Real SGLang")."""


@dataclass(frozen=True)
class SyncDeployConfig:
    """`[deploy.sync]`: how the learner's weights reach the engines after each step (qurl/weights/
    reads this table once, as `SyncSettings`)."""
    mode: Literal["delta", "full"] = "delta"
    """Weight sync after each step: delta = only the 8-bit codes, scales and pass-through values
    whose bits changed since the version the engines hold (whole tensors where that is smaller;
    everything when an engine does not hold the previous version exactly); full = every tensor,
    every time. Both are verified by digests at every sync (docs/delta_sync.md)."""
    full_every: Count = 0
    """With mode = delta: every this many syncs one is full anyway; 0 = only when needed."""
    verify_kernels_every: Count = 10
    """SGLang servers: after every full sync and every this many delta syncs, read back what the
    kernels read, after SGLang's closing repack (the transposed W8A8 weights, every copy of a tied
    head), against the learner's digests: one more short update session and hash pass per server
    (qurl/engines/sglang/inside/readback.py); a difference is a verification mismatch. 0 = never."""
    bucket_mb: PositiveFloat = 64.0
    """Weight-broadcast bucket size in MiB."""
    worker_backend: Literal["gloo", "nccl"] = "gloo"
    """Controller -> workers weight group: gloo (CPU tensors; right for SGLang workers, which
    forward to their servers) or nccl (each worker on a GPU of its own with a local engine)."""
    port: Count = 0
    """Rendezvous port of the weight-broadcast group; 0 = a free port."""


@dataclass(frozen=True)
class StreamDeployConfig:
    """`[deploy.stream]`: the ZeroMQ stream between rollout workers and the controller."""
    hwm: Positive = 1000
    """ZeroMQ high-water mark: messages queued per socket before senders wait."""
    key: str = ""
    """Shared HMAC key of the stream (>= 16 bytes); empty = random per run, kept in the run dir."""
    port: Count = 0
    """The controller's ZeroMQ inbox (trajectories, worker control); 0 = a free port."""


@dataclass(frozen=True)
class AlarmDeployConfig:
    """`[deploy.alarm]`: the mismatch alarm (qurl/train/alarm.py), a check that changes no
    training math."""
    kl_factor: Annotated[float, Min(0)] = 10.0
    """Mismatch alarm (qurl/train/alarm.py): raised when KL(behav||prox) (`kl_behav_prox`) is
    above this many times its running median for deploy.alarm.steps steps in a row, as when the
    engine samples from other weights than the learner's through a fault the sync's digests
    cannot see (a quantizer bug). Recorded as `alarm/*` keys and printed once; 0 = off (else
    > 1). A deployment check: it changes no training math."""
    steps: Positive = 3
    """Steps in a row above the factor before the mismatch alarm fires."""
    stop: bool = False
    """Stop the run when the mismatch alarm fires: one error line (exit 2), resumable from the
    last checkpoint (qurl train --resume)."""


@dataclass(frozen=True)
class RanksDeployConfig:
    """`[deploy.ranks]`: the learner's processes: how many, how they meet, how they compute."""
    nnodes: Positive = 1
    """Learner nodes."""
    nproc_per_node: Count = 0
    """Learner ranks per node; 0 = learner.tp x learner.dp / nnodes."""
    backend: Backend = "auto"
    """The learner's torch.distributed backend: auto = nccl with CUDA, else gloo."""
    port: Positive = 29500
    """The learner ranks' torch.distributed rendezvous port."""
    wait_timeout_min: PositiveFloat = 1440.0
    """Minutes a learner rank waits for rank 0 at a control point (the next batch while rank 0
    generates and evaluates, the base model it prepares, checkpoints). These waits go through a
    gloo side group with this timeout, so NCCL's 30-minute watchdog never sees them."""
    distributed_optimizer: bool = False
    """Shard fp32 master weights and AdamW moments over data-parallel ranks (ZeRO-1)."""
    transformer_engine: Literal["auto", "on", "off"] = "auto"
    """Transformer Engine layers (CUDA only): auto = when it imports and CUDA is present."""
    attention: Literal["sdpa", "unfused"] = "sdpa"
    """The learner's core attention without Transformer Engine: sdpa = torch's fused
    scaled-dot-product attention (flash / memory-efficient kernels; memory linear in the length);
    unfused = megatron's DotProductAttention, which keeps [heads, L, L] scores (the reference)."""


@dataclass(frozen=True)
class DeployConfig:
    """Where a run executes, how its processes meet, and what it writes on the side. Each
    component's settings are a table of their own (`[deploy.sync]`, `[deploy.stream]`,
    `[deploy.alarm]`, `[deploy.ranks]`), so a component is handed its table, not the tree."""
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
    eval_gpu_gb: Annotated[float, Min(0)] = 8.0
    """GB the fp policy's local engine (eval.fp_policy; weights + fp32 KV cache of its largest
    batch) may take on learner rank 0's GPU; the actor is scored on the rollout engines and takes
    none. An evaluation estimated over it is refused at start in one line
    (qurl/train/eval_placement.py); 0 = no local evaluation on the GPU. Not checked on CPU."""
    host: str = "127.0.0.1"
    """Node 0's address as the others reach it: the learner's rendezvous, the controller's
    ZeroMQ inbox and every weight-broadcast group."""
    # ---- each component's table
    ranks: RanksDeployConfig = field(default_factory=RanksDeployConfig)
    """The learner's processes (`[deploy.ranks]`)."""
    sync: SyncDeployConfig = field(default_factory=SyncDeployConfig)
    """Weight sync from the learner to the engines (`[deploy.sync]`)."""
    stream: StreamDeployConfig = field(default_factory=StreamDeployConfig)
    """The ZeroMQ trajectory stream (`[deploy.stream]`)."""
    alarm: AlarmDeployConfig = field(default_factory=AlarmDeployConfig)
    """The mismatch alarm (`[deploy.alarm]`)."""
