"""`qurl launch`: per-node torchrun + SGLang commands from one config (2-node example), placement
errors named by field, and running one node's commands."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qurl.commands.launch import main_launch
from qurl.config import load_config
from qurl.commands.launch_plan import Command, NodePlan, Reach, plan, run_node

EXAMPLE = str(Path(__file__).parents[1] / "scripts" / "example_2node.toml")


def _lines(out: str) -> list[list[str]]:
    return [shlex.split(line.rstrip(" &")) for line in out.splitlines()
            if line and not line.startswith("#")]


def test_dry_run_two_node_example(capsys):
    assert main_launch(["--preset", "paper-dapo-7b", "--config", EXAMPLE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# node 0 (10.0.0.1): 1 learner" in out and "# node 1 (10.0.0.2): 4 sglang" in out
    learner, export, *servers = _lines(out)
    net = [f"{k}=$(python -m qurl.node.netif 10.0.0.1)" for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")]
    net = ["NCCL_CUMEM_ENABLE=0", "NCCL_NVLS_ENABLE=0", *net]  # qurl's NCCL settings, everywhere
    assert learner == ["CUDA_VISIBLE_DEVICES=0,1,2,3", *net, "torchrun", "--nnodes=1",
                       "--nproc-per-node=4", "--node-rank=0", "--master-addr=10.0.0.1",
                       "--master-port=29500", "-m", "qurl.cli", "train", "--preset",
                       "paper-dapo-7b", "--config", EXAMPLE]
    ckpt = "/shared/runs/dapo-7b-2node/sglang_int8"
    assert export == ["CUDA_VISIBLE_DEVICES=", "python", "-m", "qurl.checkpoint.shared_export", "--src",
                      "/shared/models/Qwen2.5-Math-7B", "--out", ckpt, "--fmt", "int8",
                      "--uaq-scale", "1.5"]
    assert len(servers) == 4
    for k, s in enumerate(servers):
        assert s == [f"CUDA_VISIBLE_DEVICES={2 * k},{2 * k + 1}", *net, "python", "-m",
                     "sglang.launch_server", "--model-path", ckpt, "--tp-size", "2", "--host",
                     "0.0.0.0", "--port", str(30000 + k), "--weight-version", "0",
                     "--quantization", "w8a8_int8",
                     # W8A8 servers need qurl's restore for 8-bit updates (engines/sglang_loader)
                     "--custom-weight-loader", "qurl.engines.sglang.inside.loader.restore_w8a8",
                     "qurl.engines.sglang.inside.loader.prepare_sync",
                     "qurl.engines.sglang.inside.loader.read_kernels",
                     "--mem-fraction-static", "0.85"]


def test_slurm_style_placement_from_node_list():
    cfg = load_config("paper-deepscaler-1.5b", sets=[
        "model.base=/m", "learner.tp=2", "rollout.precision=fp8", "sglang.tp=4"])
    plans = plan(cfg, ["--preset", "paper-deepscaler-1.5b"], nodes=["gpu-a", "gpu-b"])
    learner = plans[0].commands[-1]
    # servers (tp 4) fill the free GPUs: 2-5 next to the learner's 0-1 on node 0, all 8 of node 1;
    # the learner is told where they are and that node 0 is its master (replacing 127.0.0.1)
    assert learner.role == "learner" and "--master-addr=gpu-a" in learner.argv
    reach = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0",
             "GLOO_SOCKET_IFNAME": Reach("gpu-a"), "NCCL_SOCKET_IFNAME": Reach("gpu-a")}
    assert learner.env == {"CUDA_VISIBLE_DEVICES": "0,1", **reach}
    assert "--nproc-per-node=2" in learner.argv
    sets = [learner.argv[i + 1] for i, a in enumerate(learner.argv) if a == "--set"]
    assert sets == ["deploy.host=gpu-a", "sglang.urls=http://gpu-a:30000,"
                    "http://gpu-b:30000,http://gpu-b:30001"]
    assert [c.role for c in plans[0].commands] == ["export", "sglang", "learner"]
    assert plans[0].commands[1].env == {"CUDA_VISIBLE_DEVICES": "2,3,4,5", **reach}
    assert [c.role for c in plans[1].commands] == ["export", "sglang", "sglang"]
    s0 = plans[1].commands[1]
    assert s0.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3", **reach} and "w8a8_fp8" in s0.argv
    assert plans[1].commands[2].env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7", **reach}
    # presets set only learner.tp: nproc_per_node (default 1) follows it
    dapo = plan(load_config("paper-dapo-7b", sets=["model.base=/m"]), [], nodes=["x", "y"])
    assert "--nproc-per-node=4" in dapo[0].commands[-1].argv
    # data parallel: tp 4 x dp 2 = the 8 GPUs of node 0; the servers go to node 1
    dp2 = plan(load_config("paper-dapo-7b", sets=["model.base=/m", "learner.dp=2"]), [],
               nodes=["x", "y"])
    assert "--nproc-per-node=8" in dp2[0].commands[-1].argv
    assert dp2[0].commands[-1].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert not any(c.role == "sglang" for c in dp2[0].commands)
    assert any(c.role == "sglang" for c in dp2[1].commands)


@pytest.mark.parametrize("sets,msg", [
    (["learner.tp=8"], "learner.tp * learner.dp=8: must equal"),
    (["learner.tp=2", "learner.dp=4", "deploy.ranks.nproc_per_node=4"],
     "learner.tp * learner.dp=8: must equal"),
    (["sglang.urls=http://elsewhere:1"], "host 'elsewhere' is not a node"),
    (["sglang.urls=10.0.0.2:30000"], "is not http://host:port"),
    (["model.base=tiny"], "model.base='tiny'"),
    (["sglang.tp=16"], "sglang.tp=16 > --gpus-per-node"),
    (["sglang.urls=" + ",".join(f"http://10.0.0.2:{30000 + k}" for k in range(5))],
     "node 10.0.0.2: servers need more than 8 GPUs"),
])
def test_placement_errors_name_the_field(sets, msg):
    cfg = load_config("paper-dapo-7b", EXAMPLE, sets)
    with pytest.raises(ValueError, match=re.escape(msg)):
        plan(cfg, [], nodes=["10.0.0.1", "10.0.0.2"])


def test_run_node_runs_export_servers_learner_and_stops_servers(tmp_path):
    py = sys.executable
    mark = tmp_path / "exported"
    node = NodePlan(0, "localhost", [
        Command("export", [py, "-c", f"open({str(mark)!r}, 'w').write('x')"]),
        Command("sglang", [py, "-c", "import time; time.sleep(120)"]),
        Command("learner", [py, "-c", "import os, sys; "
                            "sys.exit(0 if os.environ['CUDA_VISIBLE_DEVICES'] == '0' else 5)"],
                {"CUDA_VISIBLE_DEVICES": "0"}),
    ])
    assert run_node(node) == 0 and mark.read_text() == "x"  # returns once the learner exits
    assert main_launch(["--set", "learner.tp=3", "--set", "deploy.ranks.nnodes=2", "--dry-run"]) == 2


def test_async_workers_take_the_gpus_after_the_learners():
    from qurl.node import placement

    def worker_gpu(cfg, slot, n_gpus):
        return placement.worker_gpu(cfg.learner, cfg.deploy, slot, n_gpus)

    two = load_config("cpu-tiny", sets=["learner.tp=2", "deploy.engines=3"])
    assert [worker_gpu(two, s, 8) for s in range(3)] == [2, 3, 4]  # learner ranks on GPUs 0, 1
    assert [worker_gpu(two, s, 4) for s in range(3)] == [2, 3, 0]  # too few: wrap and share
    one = load_config("cpu-tiny")
    assert worker_gpu(one, 0, 1) == 0  # one GPU: everyone shares it
    nccl = load_config("cpu-tiny", sets=["deploy.sync.worker_backend=nccl", "deploy.engines=2"])
    assert [worker_gpu(nccl, s, 3) for s in range(2)] == [1, 2]
    with pytest.raises(ValueError, match="deploy.sync.worker_backend='nccl': worker 1 needs GPU 2"):
        worker_gpu(nccl, 1, 2)  # an NCCL group cannot hold two ranks on one GPU
    with pytest.raises(ValueError, match="n_gpus=0"):
        worker_gpu(one, 0, 0)


# ---------------------------------------------------------------- the paper presets on 8-GPU nodes

PAPER = ["paper-ppo-gsm8k", "paper-deepscaler-1.5b", "paper-dapo-7b"]


def _printed_gpus(out: str) -> dict[str, dict[int, list[str]]]:
    """{node: {GPU: processes}} read back from the printed commands alone: each command line's
    CUDA_VISIBLE_DEVICES; a torchrun computes on its first --nproc-per-node of them."""
    nodes: dict[str, dict[int, list[str]]] = {}
    node = ""
    for line in out.splitlines():
        if line.startswith("# node "):
            node = line.split("(")[1].split(")")[0]
            nodes[node] = {}
        elif line and not line.startswith("#"):
            words = shlex.split(line.rstrip(" &"))
            env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
            gpus = [int(g) for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
            if "torchrun" in words:
                nproc = int(next(w for w in words if w.startswith("--nproc-per-node=")).split("=")[1])
                who = [f"learner rank {k}" for k in range(nproc)]
            elif "sglang.launch_server" in words:
                who = [f"sglang :{words[words.index('--port') + 1]}"] * len(gpus)
            else:
                continue
            for g, w in zip(gpus, who):
                nodes[node].setdefault(g, []).append(w)
    return nodes


@pytest.mark.parametrize("preset", PAPER)
@pytest.mark.parametrize("hosts", [["10.0.0.1"], ["10.0.0.1", "10.0.0.2"]])
def test_paper_presets_dry_run_one_process_per_gpu(preset, hosts, capsys):
    """`qurl launch --dry-run` on 1 and 2 nodes x 8 GPUs: the learner's tp ranks on GPUs 0..tp-1
    of node 0, SGLang servers of sglang.tp GPUs filling every other GPU, one process per GPU, and
    the learner told every server's URL."""
    cfg = load_config(preset)
    tp, stp = cfg.learner.tp, cfg.sglang.tp
    assert main_launch(["--preset", preset, "--set", "model.base=/m", "--nodes", ",".join(hosts),
                        "--dry-run"]) == 0
    out = capsys.readouterr().out
    gpus = _printed_gpus(out)
    assert list(gpus) == hosts
    servers = 0
    for i, h in enumerate(hosts):
        first = tp if i == 0 else 0
        assert sorted(gpus[h]) == list(range(8)), (h, gpus[h])  # every GPU used ...
        assert all(len(who) == 1 for who in gpus[h].values()), gpus[h]  # ... by one process
        assert [gpus[h][g][0] for g in range(first)] == [f"learner rank {k}" for k in range(first)]
        n = (8 - first) // stp  # servers of sglang.tp GPUs after the learner's
        assert {gpus[h][g][0] for g in range(first, 8)} == {f"sglang :{30000 + k}" for k in range(n)}
        servers += n
    assert servers == {("paper-ppo-gsm8k", 1): 7, ("paper-ppo-gsm8k", 2): 15,
                       ("paper-deepscaler-1.5b", 1): 6, ("paper-deepscaler-1.5b", 2): 14,
                       ("paper-dapo-7b", 1): 2, ("paper-dapo-7b", 2): 6}[preset, len(hosts)]
    learner = next(w for w in _lines(out) if "torchrun" in w)
    urls = next(w for w in learner if w.startswith("sglang.urls=")).split("=", 1)[1].split(",")
    assert len(urls) == servers
    assert not any(w.startswith("deploy.engines=") for w in learner)  # sync: nothing to tell


def test_plans_refuse_two_processes_on_one_gpu():
    def cfg(*sets: str):
        return load_config("paper-dapo-7b", sets=["model.base=/m", *sets])

    # the learner's 4 ranks on a 6-GPU node; three local workers of its own would need GPUs 4-6
    with pytest.raises(ValueError, match=re.escape("deploy.engines=3: the learner's local-engine "
                                                   "workers need GPUs 4..6 of node 0")):
        plan(cfg("rollout.engine=local", "deploy.rollout=workers", "rollout.max_staleness=1",
                 "deploy.engines=3", "rollout.precision=int8"), [], nodes=["a"], gpus_per_node=6)
    # attached servers beside the learner: more GPUs than the node has
    with pytest.raises(ValueError, match="node a: servers need more than 8 GPUs"):
        plan(cfg("sglang.urls=" + ",".join(f"http://a:{30000 + k}" for k in range(3))), [],
             nodes=["a"])
    # two local workers beside two learner ranks: GPUs 2, 3 are theirs, inside the learner's
    # CUDA_VISIBLE_DEVICES (worker_gpu counts from the learner's ranks)
    ok = plan(cfg("rollout.engine=local", "deploy.rollout=workers", "rollout.max_staleness=1",
                  "deploy.engines=2", "learner.tp=2", "rollout.precision=int8"), [], nodes=["a"])
    assert ok[0].gpu_map() == {0: ["learner"], 1: ["learner"],
                               2: ["worker 0 (spawned by the learner)"],
                               3: ["worker 1 (spawned by the learner)"]}
    assert ok[0].commands[-1].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def _nccl_groups(out: str, cfg, variant: str) -> dict[str, list[tuple[str, str, int | None]]]:
    """The NCCL groups of a printed `qurl launch --dry-run`, from the commands alone: {group:
    [(member, node, GPU its rank computes on; None = no GPU)]}. A command without
    CUDA_VISIBLE_DEVICES sees every GPU and opens its rank on cuda:0 (GPU 0). Groups: the
    learner's ranks; inline, learner rank 0 + every server rank; async, the controller's (learner
    rank 0 + the workers, NCCL only with deploy.sync.worker_backend=nccl) and each worker's with its
    server (NCCL when the worker has a GPU: sglang.backend auto)."""
    node, learner, servers, workers = "", [], [], {}
    for line in out.splitlines():
        if line.startswith("# node "):
            node = line.split("(")[1].split(")")[0]
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line.rstrip(" &"))
        env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        seen = env.get("CUDA_VISIBLE_DEVICES")
        gpus = [int(g) for g in seen.split(",") if g] if seen is not None else list(range(8))
        if "torchrun" in words:
            nproc = int(next(w for w in words if w.startswith("--nproc-per-node=")).split("=")[1])
            learner += [(f"learner {node} rank {k}", node, gpus[k]) for k in range(nproc)]
        elif "sglang.launch_server" in words:
            tp = int(words[words.index("--tp-size") + 1])
            servers.append([(f"sglang {node}:{words[words.index('--port') + 1]} rank {k}", node,
                             gpus[k]) for k in range(tp)])
        elif "qurl.pipeline.worker" in words:
            slot = int(words[words.index("--slot") + 1])
            workers[slot] = (f"worker {slot}", node, gpus[0] if gpus else None)
    if variant == "workers":  # spawned by the learner: the environment the controller gives them
        from qurl.node.placement import spawned_worker_env

        from qurl.engines.kind import EngineKind

        seen = spawned_worker_env(EngineKind.of(cfg.rollout, cfg.sglang).servers_attached
                                  ).get("CUDA_VISIBLE_DEVICES")
        workers = {k: (f"worker {k} (spawned)", learner[0][1], None if seen == "" else 0)
                   for k in range(len(servers))}
    groups = {"learner": learner}
    if variant == "inline":
        groups["weights"] = [learner[0]] + [r for s in servers for r in s]
        return groups
    if cfg.deploy.sync.worker_backend == "nccl":
        groups["controller"] = [learner[0]] + list(workers.values())
    for k, server in enumerate(servers):
        if workers[k][2] is not None:  # auto: NCCL when the worker has a GPU
            groups[f"worker {k}"] = [workers[k]] + server
    return groups


@pytest.mark.parametrize("variant", ["inline", "workers", "external"])
@pytest.mark.parametrize("preset", PAPER)
def test_no_two_nccl_ranks_of_one_group_share_a_gpu(preset, variant, capsys):
    """1, 2 and 4 nodes x 8 GPUs, sync and async SGLang rollout: read the printed plan back; in
    every NCCL group each member sits on a GPU of its own, every command names its GPUs and carries
    qurl's NCCL settings. Before issue 59 external workers had no CUDA_VISIBLE_DEVICES: on nodes
    >= 1 worker k opened its rank on GPU 0, beside its own server's rank 0 ("Duplicate GPU")."""
    from qurl.weights.nccl_env import QURL_NCCL

    sets = ["model.base=/m"] + ([] if variant == "inline" else
                                [f"deploy.rollout={variant}", "rollout.max_staleness=1"])
    for n in (1, 2, 4):
        hosts = [f"10.0.0.{i + 1}" for i in range(n)]
        args = ["--preset", preset, "--nodes", ",".join(hosts), "--dry-run"]
        assert main_launch(args + [a for s in sets for a in ("--set", s)]) == 0
        out = capsys.readouterr().out
        learner = next(w for w in _lines(out) if "torchrun" in w)
        given = [learner[i + 1] for i, w in enumerate(learner) if w == "--set"]
        cfg = load_config(preset, sets=sets + given)
        for words in _lines(out):
            env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
            assert "CUDA_VISIBLE_DEVICES" in env, words
            if "qurl.checkpoint.shared_export" not in words:
                assert {k: env.get(k) for k in QURL_NCCL} == QURL_NCCL, words
        groups = _nccl_groups(out, cfg, variant)
        assert len(groups["learner"]) == cfg.learner.tp * cfg.learner.dp
        for name, members in groups.items():
            places = [(node, gpu) for _, node, gpu in members]
            assert None not in [gpu for _, gpu in places], (n, name, members)
            twice = {p: [m for m, *q in members if tuple(q) == p] for p in places
                     if places.count(p) > 1}
            assert twice == {}, (n, name, twice)


def test_sglang_workers_refuse_an_nccl_weight_group():
    for field in ("deploy.sync.worker_backend", "sglang.backend"):
        cfg = load_config("paper-dapo-7b", sets=["model.base=/m", "deploy.rollout=external",
                                                 "rollout.max_staleness=1", f"{field}=nccl"])
        with pytest.raises(ValueError, match=re.escape(f"{field}='nccl': asynchronous SGLang "
                                                       "workers forward weights")):
            plan(cfg, [], nodes=["a", "b"])


# ---------------------------------------------------------------- asynchronous runs, stopping


def _fake_model_dir(tmp: Path) -> Path:
    """What tests/fake_sglang.py and the SGLang adapter read: config.json + a tokenizer."""
    import json

    from qurl.models.tokenizer import build_tokenizer

    d = tmp / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 50, "model_type": "qwen2"}))
    build_tokenizer().save_pretrained(str(d))
    return d


def _config_of(learner: Command):
    """The config the planned `qurl train` would load, from its own --preset/--set arguments."""
    argv = learner.argv[learner.argv.index("train") + 1:]
    preset = argv[argv.index("--preset") + 1] if "--preset" in argv else "cpu-tiny"
    return load_config(preset, None, [argv[i + 1] for i, a in enumerate(argv) if a == "--set"])


def test_async_plan_starts_workers_that_reach_their_servers(tmp_path):
    """deploy.rollout=external with SGLang: the plan tells the learner deploy.engines = its 2
    servers and plans a worker per server. The planned servers are started (tests/fake_sglang.py
    in place of sglang.launch_server, same flags) and each planned worker's engine — what
    `python -m qurl.pipeline.worker --slot i` builds first — attaches to its own server: health
    probe, weight group formed, a generation served there. At 3817bc6 the learner kept
    deploy.engines=1 and every worker refused its slot (URL count check)."""
    from test_sglang_engine import FAKE, _get, _wait_healthy, engine_of

    from qurl.learner.dist import free_port
    from qurl.types import GenRequest, SamplingParams

    model = _fake_model_dir(tmp_path)
    sets = [f"model.base={model}", "rollout.engine=sglang", "rollout.precision=int8",
            "deploy.rollout=external", "rollout.max_staleness=1", f"deploy.dir={tmp_path}",
            "run.name=a"]
    cfg = load_config("cpu-tiny", sets=sets)
    port = free_port()
    node, = plan(cfg, [a for s in sets for a in ("--set", s)], nodes=["127.0.0.1"],
                 gpus_per_node=3, python=sys.executable, base_port=port)
    assert [c.role for c in node.commands] == ["export", "sglang", "sglang", "worker", "worker",
                                               "learner"]
    assert node.gpu_map() == {0: ["learner"], 1: ["sglang :" + str(port)],
                              2: ["sglang :" + str(port + 1)]}
    learned = _config_of(node.commands[-1])
    assert learned.deploy.engines == 2 and len(learned.sglang.urls) == 2
    procs = [subprocess.Popen([sys.executable, FAKE, *c.argv[3:], "--token-delay", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for c in node.commands if c.role == "sglang"]
    try:
        for u in learned.sglang.urls:
            _wait_healthy(u)
        for w in (c for c in node.commands if c.role == "worker"):
            slot = int(w.argv[w.argv.index("--slot") + 1])
            host = w.argv[w.argv.index("--host") + 1]
            url = learned.sglang.urls[slot]
            before = len(_get(url, "/_fake/requests"))
            engine = engine_of(learned, str(model), slot=slot, host=host)
            try:
                req = GenRequest(rid="r", prompt_ids=[3, 4],
                                 params=SamplingParams(max_new_tokens=2, temperature=0.0))
                assert len(engine.generate([req])[0].output_ids) == 2
            finally:
                engine.close()
            assert len(_get(url, "/_fake/requests")) > before  # it went to this slot's server
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has exited; only its parent's reaping is pending


def test_run_node_stops_the_servers_children_too(tmp_path):
    """An SGLang server forks its scheduler and detokenizer; stopping the server alone (as at
    3817bc6) left them running. run_node stops each background process's whole group."""
    pid_file = tmp_path / "child.pid"
    server = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(300)")
    learner = (f"import os, time; p = {str(pid_file)!r}\n"
               "while not os.path.exists(p) or not open(p).read(): time.sleep(0.05)")
    node = NodePlan(0, "localhost", [Command("sglang", [sys.executable, "-c", server]),
                                     Command("learner", [sys.executable, "-c", learner])])
    assert run_node(node) == 0
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = not _gone(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the server's child outlived qurl launch"


def test_a_stopped_launch_stops_what_it_started(tmp_path):
    """SIGTERM to `qurl launch --node-rank` (a scheduler cancelling the job) mid-run: the learner,
    the server and the server's child all end with it."""
    pids = tmp_path / "pids"
    server = ("import os, subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
              f"open({str(pids)!r}, 'a').write(f'{{c.pid}}\\n'); time.sleep(300)")
    learner = (f"import os, time; open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n'); "
               "time.sleep(300)")
    script = ("import sys; from qurl.commands.launch_plan import Command, NodePlan, run_node; "
              f"sys.exit(run_node(NodePlan(0, 'localhost', ["
              f"Command('sglang', [sys.executable, '-c', {server!r}]), "
              f"Command('learner', [sys.executable, '-c', {learner!r}])])))")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    launch = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 60
        while (not pids.exists() or len(pids.read_text().split()) < 2) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        started = [int(p) for p in pids.read_text().split()]
        launch.send_signal(signal.SIGTERM)
        assert launch.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 5
        while not all(_gone(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in started if not _gone(p)]
    finally:
        if launch.poll() is None:
            launch.kill()
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert len(started) == 2 and alive == []


@pytest.mark.parametrize("preset", PAPER)
def test_async_paper_plans_give_each_worker_a_server(preset):
    """deploy.rollout=workers on 2 nodes x 8 GPUs: the learner spawns one worker per server
    (deploy.engines = the servers planned, as each worker's URL-count check needs); the
    workers forward to their servers and hold no GPU, so the GPU map is the sync run's."""
    sets = ["model.base=/m", "deploy.rollout=workers", "rollout.max_staleness=1"]
    plans = plan(load_config(preset, sets=sets), [], nodes=["a", "b"])
    train = plans[0].commands[-1].argv
    given = [train[i + 1] for i, w in enumerate(train) if w == "--set"]
    urls = next(s for s in given if s.startswith("sglang.urls=")).split("=")[1].split(",")
    assert f"deploy.engines={len(urls)}" in given and len(urls) > 1
    assert not any(c.role == "worker" for p in plans for c in p.commands)
    sync = plan(load_config(preset, sets=["model.base=/m"]), [], nodes=["a", "b"])
    assert [p.gpu_map() for p in plans] == [p.gpu_map() for p in sync]


def test_a_bad_config_is_one_line_and_exit_2(capsys):
    """`qurl launch` says a config the checks refuse in one line, as every other command does."""
    from qurl.cli import main

    assert main(["launch", "--dry-run", "--set", "learner.ep=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qurl: error: learner.ep=3: must divide")
