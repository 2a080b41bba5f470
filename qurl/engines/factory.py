"""The engine a run's config asks for: the local torch decoder or an SGLang server adapter.

`make_engine` builds the rollout engine (of the sync loop, or of async worker `slot`) from the
sections it needs: `rollout`, `sglang`, the run's `SyncSettings` (qurl/weights/settings.py) and,
for SGLang, the `ServerSite` (where the run's servers are launched and how they reach its weight
group). `local_engine` is the local decoder alone (also the fp policy's evaluation engine).
`engine_wire_dtype` is the dtype those engines hold full-precision tensors in, which the weight
sync sends them in. Which kind of engine a run has is asked through `EngineKind` (kind.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qurl.config import (AlgoConfig, DeployConfig, LearnerConfig, RanksDeployConfig,
                         RolloutConfig, RunConfig, SGLangConfig)
from qurl.engines.kind import EngineKind
from qurl.types import Engine
from qurl.weights.settings import SyncSettings


@dataclass(frozen=True)
class ServerSite:
    """What the SGLang servers of a run need beyond the `sglang` section: the run directory (the
    8-bit export of launched servers, their logs; `qurl.checkpoint.rundir.run_dir_for`), how many
    engines the run has (deploy.engines), the address they reach the weight group at
    (deploy.host), the UAQ scale of the export (algo.uaq_scale), and the learner's `learner` and
    `deploy.ranks` sections: launched servers take GPUs after the learner's ranks on this node
    (qurl/node/placement.py `sglang_base_gpus`); `routes`: the run replays a mixture of experts'
    routes (algo.routing_replay=rollout), so its servers must return them (sglang.return_routes
    asks for them without replay: make_engine)."""
    run_dir: Path
    count: int
    group_host: str
    uaq_scale: float
    learner: LearnerConfig
    ranks: RanksDeployConfig
    routes: bool = False

    @classmethod
    def of(cls, deploy: DeployConfig, run: RunConfig, algo: AlgoConfig,
           learner: LearnerConfig) -> ServerSite:
        """A run's site from its `deploy`, `run`, `algo` and `learner` sections."""
        from qurl.checkpoint.rundir import run_dir_for

        return cls(run_dir=run_dir_for(deploy, run), count=deploy.engines, group_host=deploy.host,
                   uaq_scale=algo.uaq_scale, learner=learner, ranks=deploy.ranks,
                   routes=algo.routing_replay == "rollout")


def local_engine(model_dir: str, precision: str, *, seed: int) -> Engine:
    """A LocalEngine of `model_dir` at `precision` ("bf16" = the unquantized policy, for
    evaluation; block-scaled FP8, which it does not run, becomes per-channel FP8), on this
    process's current GPU when there is one."""
    import torch

    from qurl.engines.local import LocalEngine

    precision = "fp8" if precision == "fp8_block" else precision
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    return LocalEngine(model_dir, precision=precision, seed=seed, device=device)


def make_engine(rollout: RolloutConfig, sglang: SGLangConfig, sync: SyncSettings, model_dir: str,
                *, seed: int, site: ServerSite | None = None, slot: int | None = None,
                host: str = "") -> Engine:
    """The rollout engine of the sync loop (slot None) or of async worker `slot` (`host`: the
    worker's address, where SGLang servers reach its weight group; default site.group_host).
    seed: run.seed (the local engine's sampling). The local engine runs on this process's current
    GPU when there is one (`local_engine`); SGLang servers launched here get GPUs of their own
    after the learner's (qurl/node/placement.py) and need `site`."""
    kind = EngineKind.of(rollout, sglang)
    if kind.in_process:
        return local_engine(model_dir, rollout.precision, seed=seed)
    if site is None:
        raise ValueError("make_engine: SGLang engines need the run's ServerSite (site=)")
    import torch

    from qurl.engines.sglang import from_config
    from qurl.node.placement import sglang_base_gpus

    gpus = None if kind.servers_attached else sglang_base_gpus(  # launched: after the learner's
        site.learner, site.ranks, sglang, site.count, torch.cuda.device_count(), slot=slot)
    return from_config.from_section(
        sglang, model_dir, precision=rollout.precision, run_dir=site.run_dir,
        count=site.count, uaq_scale=site.uaq_scale, group_host=host or site.group_host,
        group_port=sync.port if slot is None else 0,  # async workers: one group each
        bucket_bytes=sync.bucket_bytes, slot=slot, base_gpus=gpus,
        verify_kernels_every=sync.verify_kernels_every,  # the post-repack read-back
        routes=site.routes or sglang.return_routes)


_SGLANG_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                  "float": "float32", "float32": "float32"}


def engine_wire_dtype(rollout: RolloutConfig, sglang: SGLangConfig,
                      model_dir: str | Path) -> "torch.dtype | None":
    """The dtype the rollout engines hold full-precision tensors in (embeddings, lm_head, norms,
    biases; everything with precision bf16), which is the dtype the weight sync sends them in
    (qurl.quant.named.travels_as). None for the local engine: it computes in fp32, as the masters.

    SGLang servers: `--dtype` from sglang.args, else bf16 for servers qurl launches (from its
    bf16 export), else (attached servers) SGLang's "auto" rule (0.5.23,
    configs/model_config.py): the checkpoint's dtype, and an fp32 checkpoint served in fp16 (bf16
    for Gemma models). A server launched with another dtype still loads what it is sent (its
    weight loaders cast), at the cost of a second rounding."""
    import torch

    kind = EngineKind.of(rollout, sglang)
    if kind.keeps_fp32:
        return None
    args = list(sglang.args)
    flag = "auto"
    for i, a in enumerate(args):
        if a == "--dtype" and i + 1 < len(args):
            flag = args[i + 1].lower()
        elif a.startswith("--dtype="):
            flag = a.split("=", 1)[1].lower()
    if flag == "auto" and not kind.servers_attached:
        # servers qurl launches load its own export (qurl.models.export8bit), written in bf16:
        # the base model's dtype does not matter (an fp16 guess here made every pass-through
        # land rounded to bf16 on the server: the verified sync found it, qurl/engines/sglang/verified_sync.py)
        flag = "bfloat16"
    elif flag == "auto":
        meta = json.loads((Path(model_dir) / "config.json").read_text())
        name = meta.get("dtype") or meta.get("torch_dtype") or "float32"
        if _SGLANG_DTYPES.get(str(name)) in (None, "float32"):
            gemma = str(meta.get("model_type", "")).startswith("gemma")
            flag = "bfloat16" if gemma else "float16"
        else:
            flag = str(name)
    if flag not in _SGLANG_DTYPES:
        raise ValueError(f"sglang.args --dtype {flag!r}: expected auto or one of "
                         f"{', '.join(_SGLANG_DTYPES)}")
    return getattr(torch, _SGLANG_DTYPES[flag])
