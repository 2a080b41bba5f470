"""`qurl launch`: per-node torchrun + SGLang commands from one config (2-node example), placement
errors named by field, and running one node's commands."""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from qurl.config import load_config
from qurl.launch import Command, NodePlan, Reach, main_launch, plan, run_node

EXAMPLE = str(Path(__file__).parents[1] / "scripts" / "example_2node.toml")


def _lines(out: str) -> list[list[str]]:
    return [shlex.split(line.rstrip(" &")) for line in out.splitlines()
            if line and not line.startswith("#")]


def test_dry_run_two_node_example(capsys):
    assert main_launch(["--preset", "paper-dapo-7b", "--config", EXAMPLE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# node 0 (10.0.0.1): 1 learner" in out and "# node 1 (10.0.0.2): 4 sglang" in out
    learner, export, *servers = _lines(out)
    net = [f"{k}=$(python -m qurl.netif 10.0.0.1)" for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")]
    assert learner == ["CUDA_VISIBLE_DEVICES=0,1,2,3", *net, "torchrun", "--nnodes=1",
                       "--nproc-per-node=4", "--node-rank=0", "--master-addr=10.0.0.1",
                       "--master-port=29500", "-m", "qurl.cli", "train", "--preset",
                       "paper-dapo-7b", "--config", EXAMPLE]
    ckpt = "/shared/runs/dapo-7b-2node/sglang_int8"
    assert export == ["python", "-m", "qurl.models.export8bit", "--src",
                      "/shared/models/Qwen2.5-Math-7B", "--out", ckpt, "--fmt", "int8",
                      "--uaq-scale", "1.5"]
    assert len(servers) == 4
    for k, s in enumerate(servers):
        assert s == [f"CUDA_VISIBLE_DEVICES={2 * k},{2 * k + 1}", *net, "python", "-m",
                     "sglang.launch_server", "--model-path", ckpt, "--tp-size", "2", "--host",
                     "0.0.0.0", "--port", str(30000 + k), "--weight-version", "0",
                     "--quantization", "w8a8_int8",
                     # W8A8 servers need qurl's restore for 8-bit updates (engines/sglang_loader)
                     "--custom-weight-loader", "qurl.engines.sglang_loader.restore_w8a8",
                     "--mem-fraction-static", "0.85"]


def test_slurm_style_placement_from_node_list():
    cfg = load_config("paper-deepscaler-1.5b", sets=[
        "model.base=/m", "learner.tp=2", "rollout.precision=fp8", "sglang.tp=4"])
    plans = plan(cfg, ["--preset", "paper-deepscaler-1.5b"], nodes=["gpu-a", "gpu-b"])
    learner = plans[0].commands[-1]
    # servers (tp 4) fill the free GPUs: 2-5 next to the learner's 0-1 on node 0, all 8 of node 1;
    # the learner is told where they are and that node 0 is its master (replacing 127.0.0.1)
    assert learner.role == "learner" and "--master-addr=gpu-a" in learner.argv
    reach = {"GLOO_SOCKET_IFNAME": Reach("gpu-a"), "NCCL_SOCKET_IFNAME": Reach("gpu-a")}
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
    (["learner.tp=2", "learner.dp=4", "deploy.nproc_per_node=4"],
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
    assert main_launch(["--set", "learner.tp=3", "--set", "deploy.nnodes=2", "--dry-run"]) == 2


def test_async_workers_take_the_gpus_after_the_learners():
    from qurl.placement import worker_gpu

    two = load_config("cpu-tiny", sets=["learner.tp=2", "deploy.engines=3"])
    assert [worker_gpu(two, s, 8) for s in range(3)] == [2, 3, 4]  # learner ranks on GPUs 0, 1
    assert [worker_gpu(two, s, 4) for s in range(3)] == [2, 3, 0]  # too few: wrap and share
    one = load_config("cpu-tiny")
    assert worker_gpu(one, 0, 1) == 0  # one GPU: everyone shares it
    nccl = load_config("cpu-tiny", sets=["deploy.worker_backend=nccl", "deploy.engines=2"])
    assert [worker_gpu(nccl, s, 3) for s in range(2)] == [1, 2]
    with pytest.raises(ValueError, match="deploy.worker_backend='nccl': worker 1 needs GPU 2"):
        worker_gpu(nccl, 1, 2)  # an NCCL group cannot hold two ranks on one GPU
    with pytest.raises(ValueError, match="n_gpus=0"):
        worker_gpu(one, 0, 0)
