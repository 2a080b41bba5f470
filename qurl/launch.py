"""`qurl launch`: from one config, the per-node commands of a multi-node run — and run them.

A run spans nodes: the learner (megatron TP, one torchrun per learner node) and SGLang rollout
servers. The learner's rank 0 attaches to the servers over HTTP and forms the weight-update group
with them, so the only coupling between nodes is addresses: `deploy.host` (node 0, also
the weight-group host) and the servers' `http://host:port` URLs.

Placement:
- nodes = `--nodes h0,h1,...` (Slurm passes its host list), else `deploy.host` followed
  by the distinct hosts of `sglang.urls`. Node 0 is the learner's master; the first
  `deploy.nnodes` nodes run torchrun with `deploy.nproc_per_node` ranks on GPUs 0..P-1
  (nnodes * nproc_per_node must equal the learner's tp * dp ranks; a nproc_per_node left at its
  default 0 is taken as tp * dp / nnodes, see qurl/placement.py).
- servers = `sglang.urls` when given (each host must be one of the nodes), else the free
  GPUs of every node (all of a non-learner node, those after the learner's on a learner node) are
  filled with servers of `sglang.tp` GPUs on ports 30000, 30001, ...; their URLs are
  passed to the learner with `--set sglang.urls=...`.
- on each node, servers take consecutive blocks of `sglang.tp` GPUs after the learner's.
- before its servers start, a node writes the 8-bit checkpoint (`python -m
  qurl.models.export8bit`, UAQ-scaled) under the run directory; on a shared filesystem every
  node writes the same bytes. Paths in the commands are as in the config (relative ones resolve
  against each node's working directory: launch from the same shared directory everywhere).

`qurl launch --dry-run` prints every node's commands; without it, the commands of `--node-rank`
are run (export, servers in the background, then the learner) and the servers are stopped when
the learner exits. Bad placement -> ValueError naming the config field or flag.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from qurl.config import LOCAL_BASES, PRESETS, Config, load_config
from qurl.engines.sglang import QUANTIZATION, server_command
from qurl.placement import learner_ranks_per_node

BASE_PORT = 30000


@dataclass
class Command:
    role: str  # "export" | "sglang" | "learner"
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


@dataclass
class NodePlan:
    rank: int
    host: str
    commands: list[Command] = field(default_factory=list)


def _host_port(url: str) -> tuple[str, int]:
    u = urlparse(url)
    if u.scheme != "http" or not u.hostname or not u.port:
        raise ValueError(f"sglang.urls: {url!r} is not http://host:port")
    return u.hostname, u.port


def plan(cfg: Config, config_args: list[str], nodes: list[str] | None = None,
         gpus_per_node: int = 8, python: str = "python") -> list[NodePlan]:
    """Per-node commands for `cfg`. `config_args` are the `--preset/--config/--set` arguments
    that reproduce cfg; they are forwarded to the learner's `qurl train`."""
    lc, r, d, sg = cfg.learner, cfg.rollout, cfg.deploy, cfg.sglang
    nproc, world = learner_ranks_per_node(cfg), lc.tp * lc.dp
    if d.nnodes * nproc != world:
        raise ValueError(f"learner.tp * learner.dp={world}: must equal deploy.nnodes * "
                         f"deploy.nproc_per_node = {d.nnodes} * {nproc}")
    if nproc > gpus_per_node:
        raise ValueError(f"deploy.nproc_per_node={nproc} > --gpus-per-node {gpus_per_node}")
    urls = list(sg.urls)
    if nodes is None:
        nodes = [d.host] + [h for h in dict.fromkeys(_host_port(u)[0] for u in urls)
                                    if h != d.host]
    if len(nodes) < d.nnodes:
        raise ValueError(f"deploy.nnodes={d.nnodes}: only {len(nodes)} node(s): {nodes}")
    master, extra_sets = nodes[0], []
    if master != d.host:
        extra_sets.append(f"deploy.host={master}")
    plans = [NodePlan(i, h) for i, h in enumerate(nodes)]
    used = {h: (nproc if i < d.nnodes else 0) for i, h in enumerate(nodes)}
    servers: list[tuple[str, int]] = []
    if r.engine == "sglang":
        if sg.tp > gpus_per_node:
            raise ValueError(f"sglang.tp={sg.tp} > --gpus-per-node {gpus_per_node}")
        if urls:
            servers = [_host_port(u) for u in urls]
            for h, _ in servers:
                if h not in used:
                    raise ValueError(f"sglang.urls: host {h!r} is not a node ({nodes})")
        else:
            for h in nodes:
                servers += [(h, BASE_PORT + k)
                            for k in range((gpus_per_node - used[h]) // sg.tp)]
            if not servers:
                raise ValueError("rollout.engine='sglang' needs sglang.urls or free GPUs "
                                 f"for sglang.tp={sg.tp} on some node (--nodes)")
            extra_sets.append("sglang.urls=" + ",".join(f"http://{h}:{p}"
                                                                 for h, p in servers))
        if cfg.model.base in LOCAL_BASES:
            raise ValueError(f"model.base={cfg.model.base!r}: SGLang servers launched here load a "
                             "checkpoint directory; set model.base to its path")
        quant, fmt = QUANTIZATION[r.precision]
        ckpt = str(Path(cfg.deploy.dir) / cfg.run.name / f"sglang_{fmt}")
        export = Command("export", [python, "-m", "qurl.models.export8bit", "--src",
                                    cfg.model.base, "--out", ckpt, "--fmt", fmt, "--uaq-scale",
                                    repr(cfg.algo.uaq_scale)])
        for h, port in servers:
            node = plans[nodes.index(h)]
            if not any(c.role == "export" for c in node.commands):
                node.commands.append(export)
            first = used[h]
            if first + sg.tp > gpus_per_node:
                raise ValueError(f"node {h}: servers need more than {gpus_per_node} GPUs "
                                 f"(sglang.tp={sg.tp}, --gpus-per-node)")
            used[h] = first + sg.tp
            gpus = ",".join(str(g) for g in range(first, first + sg.tp))
            node.commands.append(Command(
                "sglang", server_command(ckpt, port=port, host="0.0.0.0", tp=sg.tp,
                                         quantization=quant, extra=sg.args, python=python),
                {"CUDA_VISIBLE_DEVICES": gpus}))
    gpus = ",".join(str(g) for g in range(nproc))
    train_args = list(config_args) + [a for s in extra_sets for a in ("--set", s)]
    for i in range(d.nnodes):
        plans[i].commands.append(Command(
            "learner", ["torchrun", f"--nnodes={d.nnodes}", f"--nproc-per-node={nproc}",
                        f"--node-rank={i}", f"--master-addr={master}",
                        f"--master-port={d.learner_port}", "-m", "qurl.cli", "train", *train_args],
            {"CUDA_VISIBLE_DEVICES": gpus}))
    return plans


def render(plans: list[NodePlan]) -> str:
    lines = []
    for p in plans:
        roles = [c.role for c in p.commands]
        what = ", ".join(f"{roles.count(k)} {k}" for k in ("learner", "sglang") if k in roles)
        lines.append(f"# node {p.rank} ({p.host}): {what or 'idle'}")
        for c in p.commands:
            lines.append(c.shell() + (" &" if c.role == "sglang" else ""))
        lines.append("")
    return "\n".join(lines)


def run_node(node: NodePlan) -> int:
    """Run one node's commands: export, servers (background), learner; stop servers at the end."""
    import os

    servers: list[subprocess.Popen] = []
    try:
        for c in node.commands:
            env = dict(os.environ, **c.env)
            if c.role == "export":
                subprocess.run(c.argv, env=env, check=True)
            elif c.role == "sglang":
                servers.append(subprocess.Popen(c.argv, env=env, start_new_session=True))
        learner = [c for c in node.commands if c.role == "learner"]
        if learner:
            return subprocess.run(learner[0].argv, env=dict(os.environ, **learner[0].env)).returncode
        for s in servers:  # an engine-only node serves until its servers exit (or are killed)
            s.wait()
        return max((s.returncode or 0 for s in servers), default=0)
    finally:
        for s in servers:
            if s.poll() is None:
                s.terminate()


def main_launch(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="qurl launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-tiny", choices=sorted(PRESETS))
    p.add_argument("--config", help="TOML file with [section] tables overriding the preset")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", default=[])
    p.add_argument("--nodes", help="comma-separated node hosts, node 0 first (default: from config)")
    p.add_argument("--node-rank", type=int, default=None, help="run this node's commands")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--python", default="python", help="interpreter named in the commands")
    p.add_argument("--dry-run", action="store_true", help="print every node's commands and exit")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `qurl launch -- --preset ...` (argparse REMAINDER keeps the "--")
        argv = argv[1:]
    args = p.parse_args(argv)
    cfg = load_config(args.preset, args.config, args.set)
    config_args = ["--preset", args.preset] + (["--config", args.config] if args.config else [])
    config_args += [a for s in args.set for a in ("--set", s)]
    nodes = [h for h in args.nodes.split(",") if h] if args.nodes else None
    try:
        plans = plan(cfg, config_args, nodes, args.gpus_per_node, args.python)
    except ValueError as e:
        print(f"qurl launch: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(render(plans))
        return 0
    if args.node_rank is None or not 0 <= args.node_rank < len(plans):
        print(f"qurl launch: error: --node-rank must be in 0..{len(plans) - 1} (or use --dry-run)",
              file=sys.stderr)
        return 2
    return run_node(plans[args.node_rank])
