"""`qurl launch`: from one config, the per-node commands of a multi-node run -- and run them.

    qurl launch --preset P [--config run.toml] [--set ...] --dry-run   every node's commands
    qurl launch --preset P ... --nodes h0,h1 --node-rank R              run node R's commands

`qurl launch` parses its own options: qurl/cli.py passes them through untouched (a leading `--` is
dropped). The config is loaded as `qurl train` loads it; launch_plan.py `plan` turns it
into each node's commands (export, SGLang servers, external workers, the learner's torchrun)
with their GPUs and network settings -- its docstring, the placement rules, is this command's
--help. A placement the plan refuses, or a learner memory plan that cannot hold one row on a GPU of
`--gpu-memory-gb`, is one line `qurl launch: error: ...`, exit 2. `--dry-run` prints the plan
(commands, GPU map) and the memory plan; `--node-rank R` runs node R's commands (`run_node`) and
returns the learner's exit code.

A mixture-of-experts model.base whose shape is known here (a checkpoint, a local preset, a hub id
in KNOWN_SHAPES) is first asked what qurl/models/fits.py `check_moe_run` asks of every MoE run
(`qurl train` asks it through check_fits), before any placement: what it refuses, and what the
memory plan refuses with it (a rank that cannot hold its share of the experts), is one line,
exit 2, after the memory plan is printed; so is a learner.ep the model cannot take
(`check_learner_ep`).
"""
from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from qurl.config import PRESETS, load_config
from qurl.commands import launch_plan as launch
from qurl.commands.launch_plan import BASE_PORT, plan, render, run_node


def main_launch(argv: list[str] | None = None) -> int:
    """`qurl launch` with its own options, `argv` (default: sys.argv[1:]); the exit code."""
    p = argparse.ArgumentParser(prog="qurl launch", description=launch.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS))
    p.add_argument("--config", help="TOML file with [section] tables overriding the preset")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", default=[])
    p.add_argument("--nodes", help="comma-separated node hosts, node 0 first (default: from config)")
    p.add_argument("--node-rank", type=int, default=None, help="run this node's commands")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--python", default="python", help="interpreter named in the commands")
    p.add_argument("--server-port", type=int, default=BASE_PORT,
                   help="port of each node's first planned SGLang server (the next ones follow)")
    p.add_argument("--dry-run", action="store_true", help="print every node's commands and exit")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0,
                   help="memory of each learner GPU, for the learner memory plan (default 80)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `qurl launch -- --preset ...` (argparse REMAINDER keeps the "--")
        argv = argv[1:]
    args = p.parse_args(argv)
    cfg = load_config(args.preset, args.config, args.set)
    config_args = ["--preset", args.preset] + (["--config", args.config] if args.config else [])
    config_args += [a for s in args.set for a in ("--set", s)]
    nodes = [h for h in args.nodes.split(",") if h] if args.nodes else None
    from qurl.learner.memory_plan import plan_text

    text, refused = plan_text(cfg.model, cfg.learner, cfg.rollout, cfg.deploy,
                              args.gpu_memory_gb * 1e9, f"preset {args.preset}, GPU",
                              kl_coef=cfg.algo.kl_coef)
    moe = moe_refusal(cfg.model.base, learner_tp=cfg.learner.tp, engine=cfg.rollout.engine,
                      precision=cfg.rollout.precision, learner_ep=cfg.learner.ep,
                      sglang_tp=cfg.sglang.tp, routing_replay=cfg.algo.routing_replay)
    if moe:  # before placement: nothing about the layout matters until this changes
        print(text)
        print(f"qurl launch: error: {moe}" + (f"; and {refused}" if refused else ""),
              file=sys.stderr)
        return 2
    try:
        plans = plan(cfg, config_args, nodes, args.gpus_per_node, args.python, args.server_port)
    except ValueError as e:
        print(f"qurl launch: error: {e}", file=sys.stderr)
        return 2
    if refused:
        print(f"qurl launch: error: {refused}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(render(plans))
        print(text)
        return 0
    if args.node_rank is None or not 0 <= args.node_rank < len(plans):
        print(f"qurl launch: error: --node-rank must be in 0..{len(plans) - 1} (or use --dry-run)",
              file=sys.stderr)
        return 2
    try:
        return run_node(plans[args.node_rank])
    except ValueError as e:  # this node reaches no interface to node 0 (qurl/node/netif.py)
        print(f"qurl launch: error: {e}", file=sys.stderr)
        return 2


def moe_refusal(base: str, *, learner_tp: int, engine: str, precision: str,
                learner_ep: int = 1, sglang_tp: int = 1, routing_replay: str = "off") -> str | None:
    """qurl/models/fits.py `check_learner_ep`'s and `check_moe_run`'s one line for a model.base
    whose config fields are known here (memory_plan.model_fields): learner.ep that does not fit
    the model (any ep > 1 on a dense model), or a mixture-of-experts run check_moe_run refuses;
    None for an unknown shape or a run both accept."""
    from qurl.errors import InputError
    from qurl.learner.memory_plan import model_fields
    from qurl.models.convert import is_moe
    from qurl.models.fits import check_learner_ep, check_moe_run

    fields = model_fields(base)
    if fields is None:
        return None
    try:
        check_learner_ep(fields, learner_ep, base)
        if not is_moe(SimpleNamespace(**fields)):
            return None
        check_moe_run(base, learner_tp=learner_tp, engine=engine, precision=precision,
                      sglang_tp=sglang_tp, routing_replay=routing_replay, fields=fields)
    except InputError as e:
        return str(e)
    return None
