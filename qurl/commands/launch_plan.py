"""`qurl launch`: from one config, the per-node commands of a multi-node run — and run them.

A run spans nodes: the learner (megatron TP, one torchrun per learner node) and SGLang rollout
servers. The learner's rank 0 attaches to the servers over HTTP and forms the weight-update group
with them, so the only coupling between nodes is addresses: `deploy.host` (node 0, also
the weight-group host) and the servers' `http://host:port` URLs.

Placement:
- nodes = `--nodes h0,h1,...` (Slurm passes its host list), else `deploy.host` followed
  by the distinct hosts of `sglang.urls`. Node 0 is the learner's master; the first
  `deploy.ranks.nnodes` nodes run torchrun with `deploy.ranks.nproc_per_node` ranks on GPUs 0..P-1
  (nnodes * nproc_per_node must equal the learner's tp * dp ranks; a nproc_per_node left at its
  default 0 is taken as tp * dp / nnodes, see qurl/node/placement.py).
- servers = `sglang.urls` when given (each host must be one of the nodes), else the free
  GPUs of every node (all of a non-learner node, those after the learner's on a learner node) are
  filled with servers of `sglang.tp` GPUs (consecutive blocks after the learner's) on ports
  `--server-port` (30000), +1, ...; their URLs are passed to the learner (`--set sglang.urls=`).
- asynchronous rollout (deploy.rollout = workers | external) has one worker per engine, so the
  learner is told `deploy.engines` = the number of servers (each worker drives sglang.urls[slot]).
  External workers (`python -m qurl.pipeline.worker`) are planned too: beside their server for
  SGLang, or one per free GPU for the local engine. Workers the learner spawns itself
  (deploy.rollout=workers, local engine) take the GPUs after its ranks on node 0
  (qurl/node/placement.py `worker_gpu`), so the learner's CUDA_VISIBLE_DEVICES includes them.
- every planned process names its GPUs (CUDA_VISIBLE_DEVICES; '' = none, the export's too):
  left to CUDA's default, an SGLang worker put an NCCL rank on cuda:0 beside its server's rank 0
  on nodes >= 1 ("Duplicate GPU detected"). SGLang workers forward weights from host memory and
  get none (spawned ones too: qurl/node/placement.py `spawned_worker_env`), so both their weight
  groups run over gloo: deploy.sync.worker_backend=nccl or sglang.backend=nccl are refused with them.
- every command carries qurl's NCCL settings (qurl/weights/nccl_env.py QURL_NCCL, SGLang's
  defaults), the same in every member of a weight group; the groups check it when they form.
- every GPU holds one process: the plan refuses a layout that would put two on one GPU (a learner
  rank and a server each take most of its memory; NCCL refuses two ranks of a group on one GPU).
  Rank 0's only engine is the fp policy's (eval.fp_policy, opt-in on GPU, bounded by
  deploy.eval_gpu_gb) in-process on its GPU; the workers' servers answer the actor's evaluation.
- the learner, its servers and workers talk to node 0 (`deploy.host`) over gloo and NCCL, which
  advertise the address of GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (else of the hostname: a
  loopback address on many nodes). Every planned command sets both to the interface that node
  reaches node 0 through, found on the node itself (qurl/node/netif.py; `"$(python -m qurl.node.netif
  HOST)"` in the printed commands), unless node 0 is a loopback address (one machine).
- before its servers start, a node runs the 8-bit export (`python -m
  qurl.checkpoint.shared_export`, UAQ-scaled) into the run directory; on a shared filesystem the
  first node exports under a lock, the others wait for the complete, checksummed result. Paths
  are as in the config (relative ones resolve against each node's working directory).

`qurl launch --dry-run` prints every node's commands and GPU map; without it, those of
`--node-rank` are run (export, servers and workers in the background, then the learner) and when
the learner exits the background processes are stopped with their whole process group (an SGLang
server's scheduler and detokenizer processes too). Bad placement -> ValueError naming the config
field or flag.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from qurl.checkpoint.rundir import run_dir_for
from qurl.config import Config
from qurl.engines.kind import EngineKind
from qurl.engines.sglang.launcher import server_command
from qurl.engines.sglang.protocol import QUANTIZATION
from qurl.models.base import builds_base
from qurl.node.netif import IFNAME_VARS, interface_to
from qurl.node.placement import learner_ranks_per_node
from qurl.weights.nccl_env import QURL_NCCL

BASE_PORT = 30000
LOOPBACK = ("127.0.0.1", "localhost", "::1")
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class Reach:
    """An environment value found on the node that runs the command: the name of the interface
    it reaches `host` through (qurl/node/netif.py)."""
    host: str
    python: str = "python"

    def shell(self) -> str:
        return f'"$({self.python} -m qurl.node.netif {shlex.quote(self.host)})"'


@dataclass
class Command:
    role: str  # "export" | "sglang" | "worker" | "learner"
    argv: list[str]
    env: dict[str, str | Reach] = field(default_factory=dict)
    gpus: tuple[int, ...] = ()  # the node's GPUs this process computes on

    def shell(self) -> str:
        env = " ".join(f"{k}={v.shell() if isinstance(v, Reach) else shlex.quote(v)}"
                       for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)

    def label(self) -> str:
        """How the GPU map names this process: `learner`, `sglang :PORT`, `worker SLOT`."""
        flag = {"sglang": "--port", "worker": "--slot"}.get(self.role)
        if flag in self.argv:
            return f"{self.role} {':' if self.role == 'sglang' else ''}" \
                   f"{self.argv[self.argv.index(flag) + 1]}"
        return self.role

    def environ(self) -> dict[str, str]:
        """os.environ with this command's variables, the Reach ones resolved on this machine."""
        return dict(os.environ, **{k: interface_to(v.host) if isinstance(v, Reach) else v
                                   for k, v in self.env.items()})


@dataclass
class NodePlan:
    rank: int
    host: str
    commands: list[Command] = field(default_factory=list)
    spawned: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # by the learner

    def gpu_map(self) -> dict[int, list[str]]:
        """{GPU: the processes computing on it}: commands and the workers the learner spawns."""
        out: dict[int, list[str]] = {}
        for what, gpus in [(c.label(), c.gpus) for c in self.commands] + self.spawned:
            for g in gpus:
                out.setdefault(g, []).append(what)
        return dict(sorted(out.items()))


def _gpu_env(gpus: tuple[int, ...]) -> dict[str, str | Reach]:
    """The process's GPUs, always explicit ('' = none) — and qurl's NCCL settings."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus), **QURL_NCCL}


def _host_port(url: str) -> tuple[str, int]:
    u = urlparse(url)
    if u.scheme != "http" or not u.hostname or not u.port:
        raise ValueError(f"sglang.urls: {url!r} is not http://host:port")
    return u.hostname, u.port


def plan(cfg: Config, config_args: list[str], nodes: list[str] | None = None,
         gpus_per_node: int = 8, python: str = "python",
         base_port: int = BASE_PORT) -> list[NodePlan]:
    """Per-node commands for `cfg`. `config_args` are the `--preset/--config/--set` arguments
    that reproduce cfg; they are forwarded to the learner's `qurl train`. It takes the whole
    `Config`: it lays out every process of the run (learner, servers, workers, the export) and
    writes the `--set`s that make the learner's config agree with that layout."""
    lc, r, d, sg = cfg.learner, cfg.rollout, cfg.deploy, cfg.sglang
    nproc, world = learner_ranks_per_node(lc, d.ranks), lc.tp * lc.dp
    if d.ranks.nnodes * nproc != world:
        raise ValueError(f"learner.tp * learner.dp={world}: must equal deploy.ranks.nnodes * "
                         f"deploy.ranks.nproc_per_node = {d.ranks.nnodes} * {nproc}")
    if nproc > gpus_per_node:
        raise ValueError(f"deploy.ranks.nproc_per_node={nproc} > --gpus-per-node {gpus_per_node}")
    urls = list(sg.urls)
    if nodes is None:
        nodes = [d.host] + [h for h in dict.fromkeys(_host_port(u)[0] for u in urls)
                                    if h != d.host]
    if len(nodes) < d.ranks.nnodes:
        raise ValueError(f"deploy.ranks.nnodes={d.ranks.nnodes}: only {len(nodes)} node(s): {nodes}")
    master, extra_sets = nodes[0], []
    if master != d.host:
        extra_sets.append(f"deploy.host={master}")
    net: dict[str, str | Reach] = {} if master in LOOPBACK else \
        {k: Reach(master, python) for k in IFNAME_VARS}
    plans = [NodePlan(i, h) for i, h in enumerate(nodes)]
    used = {h: (nproc if i < d.ranks.nnodes else 0) for i, h in enumerate(nodes)}
    learner_gpus = tuple(range(nproc))
    asynchronous = d.rollout != "inline"
    servers: list[tuple[str, int]] = []
    kind = EngineKind.of(r, sg)
    if kind.forwards_weights and asynchronous:  # SGLang workers hold no GPU (module docstring)
        for name, value in (("deploy.sync.worker_backend", d.sync.worker_backend),
                            ("sglang.backend", sg.backend)):
            if value == "nccl":
                raise ValueError(f"{name}='nccl': asynchronous SGLang workers forward weights "
                                 "from host memory and hold no GPU; use gloo (or auto)")
    if kind.runs_on_servers:
        if sg.tp > gpus_per_node:
            raise ValueError(f"sglang.tp={sg.tp} > --gpus-per-node {gpus_per_node}")
        if urls:
            servers = [_host_port(u) for u in urls]
            for h, _ in servers:
                if h not in used:
                    raise ValueError(f"sglang.urls: host {h!r} is not a node ({nodes})")
        else:
            for h in nodes:
                servers += [(h, base_port + k)
                            for k in range((gpus_per_node - used[h]) // sg.tp)]
            if not servers:
                raise ValueError("rollout.engine='sglang' needs sglang.urls or free GPUs "
                                 f"for sglang.tp={sg.tp} on some node (--nodes)")
            extra_sets.append("sglang.urls=" + ",".join(f"http://{h}:{p}"
                                                                 for h, p in servers))
        if builds_base(cfg.model):
            raise ValueError(f"model.base={cfg.model.base!r} is built per run (tiny/small, or "
                             "model.warmstart_checkpoint): SGLang servers launched here load a "
                             "checkpoint directory; set model.base to its path, as given")
        quant, fmt = QUANTIZATION[r.precision]
        ckpt = str(run_dir_for(d, cfg.run) / f"sglang_{fmt}")
        export = Command("export", [python, "-m", "qurl.checkpoint.shared_export", "--src",
                                    cfg.model.base, "--out", ckpt, "--fmt", fmt, "--uaq-scale",
                                    repr(cfg.algo.uaq_scale)], {"CUDA_VISIBLE_DEVICES": ""})
        for h, port in servers:
            node = plans[nodes.index(h)]
            if not any(c.role == "export" for c in node.commands):
                node.commands.append(export)
            first = used[h]
            if first + sg.tp > gpus_per_node:
                raise ValueError(f"node {h}: servers need more than {gpus_per_node} GPUs "
                                 f"(sglang.tp={sg.tp}, --gpus-per-node)")
            used[h] = first + sg.tp
            gpus = tuple(range(first, first + sg.tp))
            node.commands.append(Command(
                "sglang", server_command(ckpt, port=port, host="0.0.0.0", tp=sg.tp,
                                         quantization=quant, extra=sg.args, python=python),
                {**_gpu_env(gpus), **net}, gpus))
        if asynchronous and d.engines != len(servers):  # one worker per server
            extra_sets.append(f"deploy.engines={len(servers)}")
        if d.rollout == "workers":  # spawned by the learner, without a GPU
            plans[0].spawned = [(f"worker {k} (spawned by the learner)", ())
                                for k in range(len(servers))]
        if d.rollout == "external":  # each worker beside its server (it forwards; no GPU)
            for slot, (h, _) in enumerate(servers):
                plans[nodes.index(h)].commands.append(
                    _worker(run_dir_for(d, cfg.run), slot, h, (), net, python))
    elif d.rollout == "workers":  # local engines the learner spawns, GPUs after its ranks
        if nproc + d.engines > gpus_per_node:
            raise ValueError(f"deploy.engines={d.engines}: the learner's local-engine workers "
                             f"need GPUs {nproc}..{nproc + d.engines - 1} of node 0, beside its "
                             f"{nproc} rank(s); --gpus-per-node is {gpus_per_node}")
        plans[0].spawned = [(f"worker {k} (spawned by the learner)", (nproc + k,))
                            for k in range(d.engines)]
        learner_gpus = tuple(range(nproc + d.engines))
    elif d.rollout == "external":  # local engines: one worker per free GPU of every node
        slots = [(h, g) for h in nodes for g in range(used[h], gpus_per_node)]
        if not slots:
            raise ValueError("deploy.rollout='external' with rollout.engine='local': no free GPU "
                             f"on any node for a worker (--gpus-per-node {gpus_per_node})")
        for slot, (h, g) in enumerate(slots):
            plans[nodes.index(h)].commands.append(
                _worker(run_dir_for(d, cfg.run), slot, h, (g,), net, python))
        if d.engines != len(slots):
            extra_sets.append(f"deploy.engines={len(slots)}")
    train_args = list(config_args) + [a for s in extra_sets for a in ("--set", s)]
    for i in range(d.ranks.nnodes):
        plans[i].commands.append(Command(
            "learner", ["torchrun", f"--nnodes={d.ranks.nnodes}", f"--nproc-per-node={nproc}",
                        f"--node-rank={i}", f"--master-addr={master}",
                        f"--master-port={d.ranks.port}", "-m", "qurl.cli", "train", *train_args],
            {**_gpu_env(learner_gpus), **net}, tuple(range(nproc))))
    for p in plans:
        for g, who in p.gpu_map().items():
            if len(who) > 1 or g >= gpus_per_node:
                raise ValueError(f"node {p.host}: GPU {g} would hold {', '.join(who)} "
                                 f"(--gpus-per-node {gpus_per_node})")
    return plans


def _worker(run_dir: Path, slot: int, host: str, gpus: tuple[int, ...],
            net: dict[str, str | Reach], python: str) -> Command:
    """An external rollout worker (qurl/pipeline/worker.py) of the run in `run_dir` for `slot` on
    node `host`."""
    env = {**_gpu_env(gpus), **net}
    return Command("worker", [python, "-m", "qurl.pipeline.worker", "--run-dir", str(run_dir),
                              "--slot", str(slot), "--host", host], env, gpus)


def _ranges(gpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, i = [], 0
    while i < len(gpus):
        j = i
        while j + 1 < len(gpus) and gpus[j + 1] == gpus[j] + 1:
            j += 1
        out.append(str(gpus[i]) if i == j else f"{gpus[i]}-{gpus[j]}")
        i = j + 1
    return ",".join(out)


def render(plans: list[NodePlan]) -> str:
    lines = []
    for p in plans:
        roles = [c.role for c in p.commands]
        what = ", ".join(f"{roles.count(k)} {k}" for k in ("learner", "sglang", "worker")
                         if k in roles)
        lines.append(f"# node {p.rank} ({p.host}): {what or 'idle'}")
        gpuless = [who for who, gpus in p.spawned if not gpus]
        if gpuless:
            lines.append(f"# no GPU (CUDA_VISIBLE_DEVICES=''): {len(gpuless)} worker(s) "
                         "spawned by the learner")
        owners: dict[str, list[int]] = {}
        for g, who in p.gpu_map().items():
            owners.setdefault(who[0], []).append(g)
        if owners:
            lines.append("# GPUs: " + "; ".join(f"{_ranges(gs)} {who}"
                                                 for who, gs in owners.items()))
        for c in p.commands:
            lines.append(c.shell() + (" &" if c.role in ("sglang", "worker") else ""))
        lines.append("")
    return "\n".join(lines)


def stop_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop `proc` and every process of its process group (started with start_new_session): an
    SGLang server forks its scheduler and detokenizer, which outlive a signal to the server alone.
    SIGTERM, then SIGKILL after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    return
            time.sleep(0.1)
    if proc.poll() is None:
        proc.wait()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_node(node: NodePlan) -> int:
    """Run one node's commands: export, servers and workers (background), learner. Each in its
    own process group; when the learner exits, or this process is stopped (SIGTERM, Ctrl-C: a
    scheduler cancelling the job), every group is stopped, so nothing outlives the launch."""
    started: list[subprocess.Popen] = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        for c in node.commands:
            if c.role == "export":
                subprocess.run(c.argv, env=c.environ(), check=True)
            elif c.role in ("sglang", "worker"):
                started.append(subprocess.Popen(c.argv, env=c.environ(), start_new_session=True))
        learner = [c for c in node.commands if c.role == "learner"]
        if learner:
            started.append(subprocess.Popen(learner[0].argv, env=learner[0].environ(),
                                            start_new_session=True))
            return started[-1].wait()
        for s in started:  # a node without learner serves until its processes exit
            s.wait()
        return max((s.returncode or 0 for s in started), default=0)
    finally:
        for s in reversed(started):  # the learner first: it may still be talking to the servers
            stop_group(s)
        if main:
            signal.signal(signal.SIGTERM, previous)
