"""Helpers for the tests that run the REAL SGLang 0.5.23 server on CPU (tests/test_sglang_real*.py).

The server runs from `.venv-sglang` (built by `make test-sglang`, see tests/sglang_cpu/) through
SGLang's generic CPU path: `--device cpu --attention-backend torch_native --sampling-backend
pytorch` (../README: "Real SGLang on CPU"). bf16 servers generate; 8-bit servers load, take
updates and read back, but cannot generate on CPU (their first forward calls Triton kernels), so
they are started with `--skip-server-warmup` and probed with /model_info instead of /health.

Parameters are read back with the test-only custom loader tests/sglang_cpu/qurl_sglang_dump.py,
always inside a begin / restore / dump / end session (qurl's restore first, so the session's
closing post-processing never transposes a W8A8 weight twice).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from qurl.engines.sglang.engine import SGLangEngine, Timeouts
from qurl.engines.sglang.inside.loader import KERNELS_LOAD_FORMAT
from qurl.engines.sglang.inside.loader import LOAD_FORMAT as RESTORE
from qurl.engines.sglang.launcher import ServerSpec, server_command
from qurl.engines.sglang.protocol import NO_TENSORS
from qurl.models.hf import build_model, read_state_dict
from qurl.weights.group import free_port

REPO = Path(__file__).resolve().parents[1]
SGL_PY = Path(os.environ.get("QURL_SGLANG_PYTHON") or REPO / ".venv-sglang" / "bin" / "python")
SHIMS = REPO / "tests" / "sglang_cpu"
# --mem-fraction-static: SGLang sizes the KV pool from the free memory it measures around the
# weight load, which other processes on a busy machine move; --max-total-tokens caps the pool
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend",
             "pytorch", "--mem-fraction-static", "0.2", "--max-total-tokens", "8192")
DUMP = "qurl_sglang_dump.dump_params"
DUMP_PTRS = "qurl_sglang_dump.dump_ptrs"
CORRUPT = "qurl_sglang_dump.corrupt_one_code"
CORRUPT_KV_LAST = "qurl_sglang_dump.corrupt_kv_code_last_rank"
BREAK_REPACK = "qurl_sglang_dump.corrupt_next_verified_repack"
TIMEOUTS = Timeouts(control_s=60, generate_s=120, group_s=120, launch_s=1200, health_s=10)

needs_sglang = [
    pytest.mark.sglang,
    pytest.mark.skipif(not SGL_PY.is_file() and not os.environ.get("QURL_REQUIRE_SGLANG"), reason=f"no real SGLang at {SGL_PY}: "
                       "`make test-sglang` builds .venv-sglang and runs these tests"),
]


def server_env(dump_dir: Path) -> dict[str, str]:
    """What a real server needs in its environment here (set on os.environ: servers inherit it)."""
    path = os.pathsep.join([str(SHIMS), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path.rstrip(os.pathsep), "HF_HUB_OFFLINE": "1",
            "QURL_SGLANG_DUMP_DIR": str(dump_dir), "SGLANG_DISABLE_REQUEST_LOGGING": "1"}


def tp_env(tp: int) -> dict[str, str]:
    """SGLang's CPU path needs one OpenMP core list per TP rank when a machine has fewer NUMA
    nodes than ranks ("SGLANG_CPU_OMP_THREADS_BIND is not set ..."); lists may repeat a core."""
    cores = sorted(os.sched_getaffinity(0))
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(cores[r % len(cores)]) for r in range(tp))}


def cpu_server_args(generates: bool) -> tuple[str, ...]:
    return CPU_FLAGS + ("--custom-weight-loader", DUMP, DUMP_PTRS, CORRUPT, CORRUPT_KV_LAST,
                        BREAK_REPACK, KERNELS_LOAD_FORMAT) + (
        () if generates else ("--skip-server-warmup",))


def launch(model_dir: Path, quantization: str | None, log_dir: Path, *, precision: str,
           generates: bool, tokenizer=None, vocab_size: int = 0, tp: int = 1,
           extra: tuple[str, ...] = ()) -> SGLangEngine:
    """One qurl-launched real server on a free port, driven by qurl's SGLangEngine (gloo group).
    tp > 1: qurl's launch sets SGLANG_CPU_OMP_THREADS_BIND for a CPU server unless the
    environment has it (qurl/engines/sglang/launcher.py `launch_env`; `tp_env` sets it here).
    `extra`: more server flags (e.g. --enable-return-routed-experts)."""
    port = free_port()
    cmd = server_command(str(model_dir), port=port, tp=tp, quantization=quantization,
                         extra=cpu_server_args(generates) + tuple(extra), python=str(SGL_PY))
    return SGLangEngine([ServerSpec(f"http://127.0.0.1:{port}", tp=tp, command=cmd)],
                        precision=precision,
                        backend="gloo", timeouts=TIMEOUTS, log_dir=log_dir, tokenizer=tokenizer,
                        vocab_size=vocab_size, ready_probe="/health" if generates else "/model_info")


def read_back(engine: SGLangEngine, dump_dir: Path, *, rank: int = 0) -> dict[str, torch.Tensor]:
    """Every parameter TP rank `rank` of the (single) server holds, in its loading-time layout
    ([out, in] weights)."""
    return read_back_with_ptrs(engine, dump_dir, rank=rank)[0]


def read_back_with_ptrs(engine: SGLangEngine, dump_dir: Path, *, rank: int = 0
                        ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(read_back, {parameter name: data_ptr} of the post-processed parameters the server computes
    with: read before the session's restore, i.e. where a captured CUDA graph would read)."""
    return read_back_ranks(engine, dump_dir)[rank]


def read_back_ranks(engine: SGLangEngine, dump_dir: Path
                    ) -> list[tuple[dict[str, torch.Tensor], dict[str, int]]]:
    """read_back_with_ptrs for every TP rank of the (single) server, from one session."""
    s = engine.servers[0]
    payload = {"serialized_named_tensors": [NO_TENSORS] * s.spec.tp, "flush_cache": False}
    before = set(dump_dir.glob("*.pt"))
    s.post_json("/begin_weight_update", {}, 30)
    try:
        s.post_json("/update_weights_from_tensor", {**payload, "load_format": DUMP_PTRS}, 60)
        if RESTORE in s.spec.command:  # W8A8: restore first (an unknown load_format kills SGLang)
            s.post_json("/update_weights_from_tensor", {**payload, "load_format": RESTORE}, 30)
        s.post_json("/update_weights_from_tensor", {**payload, "load_format": DUMP}, 60)
    finally:
        s.post_json("/end_weight_update", {}, 30)
    new = set(dump_dir.glob("*.pt")) - before
    out = []
    for rank in range(s.spec.tp):
        (params,) = [p for p in new if p.name.startswith(f"tp{rank}_")]
        (ptrs,) = [p for p in new if p.name.startswith(f"ptrs_tp{rank}_")]
        out.append((torch.load(params), torch.load(ptrs)))
    return out


def push_versions(sync, engine: SGLangEngine, versions: list[dict[str, torch.Tensor]]
                  ) -> list[dict]:
    """Push versions 1..N in order through `sync` (a qurl WeightSync); each push's record, with
    its wall time in `wall_s`."""
    recs = []
    for k, w in enumerate(versions, start=1):
        t0 = time.perf_counter()
        recs.append(sync.push(iter(w.items()), engine, version=k))
        recs[-1]["wall_s"] = time.perf_counter() - t0
    return recs


def checksums(engine: SGLangEngine) -> dict[str, str]:
    """/weights_checker checksums (SHA of each dequantized parameter), as the server computes them."""
    s = engine.servers[0]
    status, raw = s.call("POST", "/weights_checker", {"action": "checksum"}, 60)
    assert status == 200, raw[:300]
    (rank,) = json.loads(raw)["ranks"]  # {"success", "message", "ranks": [per TP rank]}
    return dict(rank["checksums"])


FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def held_like(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """The part of a held parameter that corresponds to qurl's tensor: SGLang pads the vocabulary
    of embed_tokens / lm_head to a multiple of its padding size (100 rows -> 128)."""
    if got.shape != want.shape and got.dim() == 2 and got.shape[1:] == want.shape[1:]:
        return got[: want.shape[0]]
    return got


def fuse_like_sglang(chunks: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """qurl's per-linear HF chunks -> SGLang's fused parameters (q|k|v -> qkv_proj, gate|up ->
    gate_up_proj, concatenated along the output dim, codes and per-channel scales alike)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in chunks:
        pieces = name.split(".")
        hit = next((i for i, p in enumerate(pieces) if p in FUSED), None)
        if hit is None:
            out[name] = t
            continue
        fused, idx = FUSED[pieces[hit]]
        key = ".".join(pieces[:hit] + [fused] + pieces[hit + 1:])
        parts.setdefault(key, {})[idx] = t
    for key, by_idx in parts.items():
        out[key] = torch.cat([by_idx[i] for i in sorted(by_idx)], dim=0)
    return out


# ------------------------------- shared by tests/test_sglang_real*.py (fixtures: import them)
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The servers' environment (server_env) for one test module; yields the dump directory."""
    dump = tmp_path_factory.mktemp("dump")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in server_env(dump).items():
            mp.setenv(k, v)
        yield dump


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen2 (4 heads of 64 so every fused q/k/v output is a multiple of 128, as block
    FP8 needs) as v0, and v1 = v0 with every tensor moved (what a training step would send)."""
    root = tmp_path_factory.mktemp("models")
    src = build_model(root / "v0", "tiny", seed=0,
                      overrides={"num_attention_heads": 4, "num_key_value_heads": 4})
    v0 = read_state_dict(src)
    g = torch.Generator().manual_seed(1)
    v1 = {k: t + 0.1 * torch.randn(t.shape, generator=g) * t.float().std().clamp_min(0.05)
          for k, t in v0.items()}
    return root, src, v0, v1


def write_model(root: Path, src: Path, state: dict, name: str) -> Path:
    from qurl.models.hf import write_state_dict

    out = root / name
    if not out.exists():
        import shutil

        shutil.copytree(src, out)
        write_state_dict(out, state)
    return out


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (0-dim ones too: block FP8 layers hold scalar k/v scales)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def is_8bit(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int8, torch.float8_e4m3fn)


def sglang_pids(mark: str = "") -> set[int]:
    """Pids of live SGLang server processes (launcher and its `sglang::` children); with `mark`,
    only those whose environment holds QURL_TEST_MARK=mark (inherited from the command that
    started them: other sessions on this machine run servers of their own)."""
    pids = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            state = (d / "stat").read_text().split(") ")[-1][:1]
            if mark and f"QURL_TEST_MARK={mark}".encode() not in \
                    (d / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        if state != "Z" and (b"sglang.launch_server" in cmd or cmd.startswith(b"sglang::")):
            pids.add(int(d.name))
    return pids


def run_leaving_no_server(argv: list[str], what: str) -> None:
    """Run a qurl command line; it must succeed, and the SGLang servers it launched (in their own
    sessions, so not its children) must be gone after it."""
    import uuid

    mark = uuid.uuid4().hex
    env = dict(os.environ, QURL_SGLANG_PYTHON=str(SGL_PY), QURL_TEST_MARK=mark)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    deadline = time.monotonic() + 60
    while (left := sglang_pids(mark)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"SGLang processes outlived `{what}`: {sorted(left)}"
