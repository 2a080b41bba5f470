"""An SGLangEngine from a run's `sglang` section: attach to running servers or launch new ones.

Attached servers (`sglang.urls`) are taken as they are: their /server_info is checked against
the section when the engine starts. Launched ones first need a checkpoint they can load: the base
model exported in the rollout's 8-bit format, UAQ-scaled as the learner's masters are
(qurl/models/export8bit.py), written under the run directory so async workers never share a
write. Each launched server gets a free port and, on GPU hosts, its own first GPU. A run that
replays a mixture of experts' routes (`routes`; or measures its flips against them without
replay, sglang.return_routes) launches its servers with `--enable-return-routed-experts` and has
the engine ask every request for them; attached servers must have been started with it (the first
reply without routes says so).
"""
from __future__ import annotations

from pathlib import Path

from qurl.config import ConfigError, SGLangConfig
from qurl.engines.sglang.engine import SGLangEngine, Timeouts
from qurl.engines.sglang.inside.tp_cut import Layout
from qurl.engines.sglang.launcher import ServerSpec, server_command
from qurl.engines.sglang.protocol import QUANTIZATION, ROUTES_FLAG
from qurl.models.moe import route_shape
from qurl.weights.group import free_port

def from_section(sg: SGLangConfig, model_dir: str, *, precision: str, run_dir: Path, count: int,
                 uaq_scale: float, group_host: str, group_port: int, bucket_bytes: int,
                 slot: int | None = None, base_gpus: list[int] | None = None,
                 verify_kernels_every: int = 10, routes: bool = False) -> SGLangEngine:
    """Attach to `sg.urls`, or export `model_dir` as an 8-bit checkpoint (UAQ-scaled, under
    run_dir) and launch local servers on free ports: `count` of them for the sync loop (slot
    None), or the one server of async worker `slot` (its URL is sg.urls[slot]). group_host /
    group_port: where the servers reach this process's weight group (port 0 = a free one).
    base_gpus: the first GPU of each launched server (`--base-gpu-id`; qurl/node/placement.py
    `sglang_base_gpus`), unless sg.args sets it; None = no placement (CPU).
    verify_kernels_every: deploy.sync.verify_kernels_every (verified_sync.py). routes: the run
    needs the servers' routes (algo.routing_replay=rollout, or sglang.return_routes; the model
    must be a MoE)."""
    quant, fmt = QUANTIZATION[precision]
    from transformers import AutoConfig, AutoTokenizer

    hf = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    shape = route_shape(hf.to_dict()) if routes else None
    if routes and shape is None:
        raise ConfigError(f"algo.routing_replay=rollout or sglang.return_routes=true: "
                          f"{model_dir} is a dense model, it has no experts to route")
    args = list(sg.args)
    if routes and ROUTES_FLAG not in args:
        args.append(ROUTES_FLAG)
    urls = list(sg.urls)
    if slot is not None:
        if urls and len(urls) != count:
            raise ValueError(f"sglang.urls has {len(urls)} servers: asynchronous rollout needs "
                             f"one per worker (deploy.engines={count})")
        urls, count = urls[slot:slot + 1], 1
    if urls:
        specs = [ServerSpec(u, tp=sg.tp) for u in urls]
    else:
        from qurl.models.export8bit import export_8bit

        name = f"sglang_{fmt}" if slot is None else f"sglang_{fmt}_w{slot}"  # no shared writes
        ckpt = export_8bit(model_dir, run_dir / name, fmt, uaq_scale=uaq_scale)
        if base_gpus is not None and len(base_gpus) != count:
            raise ValueError(f"base_gpus {base_gpus}: one per server ({count})")
        specs = []
        for i in range(count):
            port = free_port()
            cmd = server_command(str(ckpt), port=port, tp=sg.tp, quantization=quant,
                                 extra=args, base_gpu=None if base_gpus is None
                                 else base_gpus[i])
            specs.append(ServerSpec(f"http://127.0.0.1:{port}", tp=sg.tp, command=cmd))
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    engine = SGLangEngine(specs, precision=precision, group_host=group_host, group_port=group_port,
                 backend=sg.backend, bucket_bytes=bucket_bytes, log_dir=run_dir / "logs",
                 tokenizer=tok, vocab_size=int(hf.vocab_size), layout=Layout.of_config(hf),
                 max_running=sg.max_running, timeouts=Timeouts(stall_s=sg.stall_s),
                 top_logprobs=sg.top_logprobs, routes=shape)
    engine.verify_kernels_every = verify_kernels_every
    return engine

