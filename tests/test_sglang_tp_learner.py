"""The learner's side of delta / verified syncs to TP > 1 SGLang servers (qurl/engines/sglang/verified_sync.py)
and how qurl starts a CPU server at TP > 1 (qurl/engines/sglang/launcher.py `launch_env`), without
a server: when a TP-2 server is offered deltas and verification, and when it falls back to full,
unverified syncs saying why."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

from qurl.engines.sglang.inside.layout import HEADER, read_json_chunk
from qurl.engines.sglang.inside.loader import SYNC_LOAD_FORMAT
from qurl.engines.sglang.inside.tp_cut import Layout
from qurl.engines.sglang.launcher import launch_env
from qurl.engines.sglang.verified_sync import SGLangDeltaMixin, layout_of_model_dir


def _engine(tp: int, layout: Layout | None, loaders=(SYNC_LOAD_FORMAT,),
            device: str = "cuda") -> SGLangDeltaMixin:
    eng = SGLangDeltaMixin()
    eng.servers = [SimpleNamespace(spec=SimpleNamespace(tp=tp), custom_loaders=loaders,
                                   layout=layout, device=device)]
    return eng


CHUNKS = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(8, 8, dtype=torch.int8)),
          ("model.layers.0.self_attn.o_proj.weight", torch.zeros(8, 8, dtype=torch.int8)),
          ("model.norm.weight", torch.zeros(8, dtype=torch.bfloat16))]


def test_tp2_with_head_counts_takes_deltas_and_verification():
    eng = _engine(2, Layout(4, 1))
    assert eng.delta_capable and eng.can_verify
    wire = eng._wire(CHUNKS, 1, None)
    assert wire[0][0] == HEADER and read_json_chunk(wire[0][1])["version"] == 1
    assert eng.tp_refusal is None and eng.can_verify


def test_tp2_without_head_counts_or_loader_gets_full_syncs():
    assert not _engine(2, None).delta_capable and not _engine(2, None).can_verify
    assert not _engine(2, Layout(4, 4), loaders=()).delta_capable
    assert _engine(1, None).delta_capable  # TP 1 needs no head counts


def test_a_tensor_the_map_cannot_cut_turns_verification_off_saying_why():
    eng = _engine(2, Layout(4, 1))
    odd = CHUNKS + [("model.layers.0.mlp.experts.0.w1.weight", torch.zeros(4, 4))]
    assert eng._wire(odd, 1, None) == odd  # sent whole, without qurl's header
    assert "experts.0.w1.weight" in eng.tp_refusal and "TP 2" in eng.tp_refusal
    assert not eng.delta_capable and not eng.can_verify


def test_a_cpu_server_that_pads_its_cut_gets_full_syncs():
    """One kv head at TP 2: the GPU path replicates it (mapped), SGLang's CPU path pads it."""
    assert _engine(2, Layout(4, 1), device="cuda")._wire(CHUNKS, 1, None)[0][0] == HEADER
    eng = _engine(2, Layout(4, 1), device="cpu")
    assert eng._wire(CHUNKS, 1, None) == CHUNKS
    assert "pads 4 query / 1 key-value heads" in eng.tp_refusal and not eng.can_verify
    mlp = CHUNKS + [("model.layers.0.mlp.gate_proj.weight", torch.zeros(96, 8))]
    eng = _engine(2, Layout(4, 2), device="cpu")
    assert eng._wire(mlp, 1, None) == mlp and "SwiGLU size 96" in eng.tp_refusal


def test_layout_from_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9,
                                                      "num_key_value_heads": 3}))
    assert layout_of_model_dir(str(tmp_path)) == Layout(9, 3)
    assert layout_of_model_dir(str(tmp_path / "missing")) is None
    assert layout_of_model_dir(None) is None


def test_cpu_tp_servers_get_one_core_list_per_rank():
    cores = sorted(os.sched_getaffinity(0))
    cmd = ["python", "-m", "sglang.launch_server", "--tp-size", "2", "--device", "cpu"]
    env = launch_env(cmd, 2, {})
    lists = env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")
    assert len(lists) == 2
    used = [int(c) for lst in lists for c in lst.split(",")]
    assert set(used) <= set(cores)
    if len(cores) >= 2:  # disjoint, equal groups
        assert len(set(used)) == len(used) and len({len(x.split(",")) for x in lists}) == 1
    # already set, a GPU server, or TP 1: left alone
    assert {k: v for k, v in launch_env(cmd, 2, {"SGLANG_CPU_OMP_THREADS_BIND": "7|8"}).items()
            if not k.startswith("NCCL_")} == \
        {"SGLANG_CPU_OMP_THREADS_BIND": "7|8"}
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in launch_env(cmd[:-2], 2, {})
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in launch_env(cmd, 1, {})
    assert launch_env(["x", "--device=cpu"], 3, {"A": "1"})["A"] == "1"
