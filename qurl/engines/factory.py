"""The engine a run's config asks for: the local torch decoder or an SGLang server adapter.

`make_engine` builds the rollout engine (of the sync loop, or of async worker `slot`) or the
fp policy's local evaluation engine; `engine_wire_dtype` is the dtype those engines hold full-precision
tensors in, which the weight sync sends them in.
"""
from __future__ import annotations

import json
from pathlib import Path

from qurl.config import Config
from qurl.types import Engine


def make_engine(cfg: Config, model_dir: str, *, slot: int | None = None, host: str = "",
                local: bool = False, precision: str | None = None) -> Engine:
    """The rollout engine of the sync loop (slot None) or of async worker `slot` (`host`: the
    worker's address, where SGLang servers reach its weight group). local=True: a LocalEngine
    whatever rollout.engine says (the fp policy's evaluation engine, which must not take the
    rollout's SGLang servers); block-scaled FP8, which it does not run, becomes per-channel FP8.
    The local engine runs on this process's current GPU when there is one; SGLang servers
    launched here get GPUs of their own after the learner's (qurl/node/placement.py). precision: overrides
    rollout.precision (with local=True; "bf16" = the unquantized policy, for evaluation)."""
    if cfg.rollout.engine == "local" or local:
        import torch

        from qurl.engines.local import LocalEngine

        precision = precision or cfg.rollout.precision
        precision = "fp8" if precision == "fp8_block" else precision
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        return LocalEngine(model_dir, precision=precision, seed=cfg.run.seed, device=device)
    import torch

    from qurl.checkpoint.rundir import run_dir_for
    from qurl.engines.sglang import from_config
    from qurl.node.placement import sglang_base_gpus

    d = cfg.deploy
    gpus = None if cfg.sglang.urls else sglang_base_gpus(  # launched here: after the learner's
        cfg, d.engines, torch.cuda.device_count(), slot=slot)
    return from_config.from_section(
        cfg.sglang, model_dir, precision=cfg.rollout.precision, run_dir=run_dir_for(cfg),
        count=d.engines, uaq_scale=cfg.algo.uaq_scale, group_host=host or d.host,
        group_port=d.sync.port if slot is None else 0,  # async workers: one group each
        bucket_bytes=int(d.sync.bucket_mb * (1 << 20)), slot=slot, base_gpus=gpus,
        verify_kernels_every=d.sync.verify_kernels_every)  # the post-repack read-back


_SGLANG_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16",
                  "float": "float32", "float32": "float32"}


def engine_wire_dtype(cfg: Config, model_dir: str | Path) -> "torch.dtype | None":
    """The dtype the rollout engines hold full-precision tensors in (embeddings, lm_head, norms,
    biases; everything with precision bf16), which is the dtype the weight sync sends them in
    (qurl.quant.named.travels_as). None for the local engine: it computes in fp32, as the masters.

    SGLang servers: `--dtype` from sglang.args, else bf16 for servers qurl launches (from its
    bf16 export), else (attached servers) SGLang's "auto" rule (0.5.23,
    configs/model_config.py): the checkpoint's dtype, and an fp32 checkpoint served in fp16 (bf16
    for Gemma models). A server launched with another dtype still loads what it is sent (its
    weight loaders cast), at the cost of a second rounding."""
    import torch

    if cfg.rollout.engine != "sglang":
        return None
    args = list(cfg.sglang.args)
    flag = "auto"
    for i, a in enumerate(args):
        if a == "--dtype" and i + 1 < len(args):
            flag = args[i + 1].lower()
        elif a.startswith("--dtype="):
            flag = a.split("=", 1)[1].lower()
    if flag == "auto" and not cfg.sglang.urls:
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
