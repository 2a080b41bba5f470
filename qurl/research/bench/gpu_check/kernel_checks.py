"""GPU check sections of the kernels: env, gemm, cuda_graph, engine (see __init__.py).

Each `section_<name>(dry)` runs in its own process (runner.py) and returns a JSON-able dict with a
one-line "summary"; `dry` = the CPU dry run at tiny sizes. Nothing here asserts: it measures.
"""
from __future__ import annotations

import importlib
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from qurl.research.bench.gpu_check import Skip

# (K, N) of each linear: qkv fused (q + 2 kv heads x 128), o, gate+up fused, down.
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "qwen2.5-1.5b": {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920),
                     "down": (8960, 1536)},
    "qwen2.5-7b": {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888),
                   "down": (18944, 3584)},
}
# distribution -> import name, of qurl's dependencies (pyproject.toml) and the optional ones
DEPS = {"torch": "torch", "numpy": "numpy", "megatron-core": "megatron.core",
        "transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors",
        "pyzmq": "zmq", "blake3": "blake3", "math-verify": "math_verify", "pyarrow": "pyarrow",
        "matplotlib": "matplotlib", "tqdm": "tqdm", "wandb": "wandb", "gguf": "gguf",
        "transformer-engine": "transformer_engine", "sglang": "sglang"}


def _device(dry: bool) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if dry:
        return torch.device("cpu")
    raise Skip("needs CUDA")


def section_env(dry: bool) -> dict[str, Any]:
    """Versions: Python, torch, CUDA, cuDNN, NCCL, device; each dependency's version and folder."""
    from importlib import metadata

    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version()}
    if out["cuda"]:
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1),
                   sms=props.multi_processor_count, devices=torch.cuda.device_count())
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # a torch without NCCL
            out["nccl"] = f"unavailable: {e}"
    deps: dict[str, Any] = {}
    for dist, mod in DEPS.items():
        try:
            spec = importlib.util.find_spec(mod)
        except ImportError:  # its parent package is absent
            spec = None
        if spec is None or spec.origin is None:
            deps[dist] = None
            continue
        try:
            ver = metadata.version(dist)
        except metadata.PackageNotFoundError:
            ver = "?"
        depth = mod.count(".") + (Path(spec.origin).name == "__init__.py")
        deps[dist] = {"version": ver, "from": str(Path(spec.origin).parents[depth])}
    out["deps"] = deps
    out["transformer_engine"] = deps["transformer-engine"] is not None
    missing = [d for d in ("megatron-core", "blake3", "pyzmq") if deps[d] is None]
    dev = f"{out.get('device', 'no CUDA device')}, CUDA {out['torch_cuda']}, NCCL {out.get('nccl')}"
    out["summary"] = (f"Python {out['python']}, torch {out['torch']}, {dev}, Transformer Engine "
                      f"{'present' if out['transformer_engine'] else 'absent'}"
                      + (f"; MISSING {missing}" if missing else ""))
    return out


def _timer(dev: torch.device) -> Callable[[Callable[[], Any], int], float]:
    """time_it(fn, iters) -> seconds per call (CUDA events on a GPU, perf_counter on a CPU)."""
    def cuda(fn: Callable[[], Any], iters: int) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / iters

    def cpu(fn: Callable[[], Any], iters: int) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    return cuda if dev.type == "cuda" else cpu


def gemm_weights(dev: torch.device, K: int, N: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One layer's weight [N, K] as bf16, int8 codes and e4m3 codes, made on `dev` (g: its generator)."""
    w = torch.randn(N, K, device=dev, generator=g).to(torch.bfloat16)
    return {"bf16": w, "int8": torch.randint(-127, 128, (N, K), device=dev, generator=g,
                                             dtype=torch.int8),
            "fp8": (w / 4).to(torch.float8_e4m3fn)}


def gemm_ops(dev: torch.device, M: int, w: dict[str, torch.Tensor], g: torch.Generator
             ) -> dict[str, Callable[[], Any] | str]:
    """bf16 / int8 / fp8 products [M, K] x [N, K]^T as qurl's linears issue them (int8: qurl's
    `int8_matmul`, rows padded to 32 on CUDA; fp8: `_scaled_mm`, unit scales, fp32 out, on CUDA,
    the fp32 emulation on a CPU); an op this torch/device refuses is its error message instead."""
    from qurl.engines.kernels import int8_matmul

    K = w["bf16"].shape[1]
    a = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
    a8 = torch.randint(-127, 128, (M, K), device=dev, generator=g, dtype=torch.int8)
    af = (a / 4).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    ops: dict[str, Callable[[], Any] | str] = {
        "bf16": lambda: a @ w["bf16"].t(),
        "int8": lambda: int8_matmul(a8, w["int8"]),
        "fp8": lambda: torch._scaled_mm(af, w["fp8"].t(), scale_a=one, scale_b=one,
                                        out_dtype=torch.float32)}
    if dev.type != "cuda":  # qurl emulates FP8 on a CPU (torch's CPU _scaled_mm is ~100x slower)
        ops["fp8"] = lambda: af.to(torch.float32) @ w["fp8"].to(torch.float32).t()
    for name, fn in list(ops.items()):
        try:
            fn()  # warm-up (cuBLAS heuristics, allocator); a refusal is recorded, not raised
        except Exception as e:
            ops[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return ops


def section_gemm(dry: bool) -> dict[str, Any]:
    """Median seconds per GEMM (interleaved repeats) and each 8-bit op's speed-up over bf16."""
    dev = _device(dry)
    ms, reps, scale = ((1, 64), 2, 8) if dry else ((1, 64, 4096), 7, 1)
    time_it, g = _timer(dev), torch.Generator(device=dev).manual_seed(0)
    rows: list[dict[str, Any]] = []
    for model, layers in SHAPES.items():
        for layer, (K, N) in layers.items():
            K, N = K // scale, N // scale
            w = gemm_weights(dev, K, N, g)
            for M in ms:
                ops = gemm_ops(dev, M, w, g)
                iters = 1 if dry else max(1, min(50, int(4e10 / (M * K * N))))
                times: dict[str, list[float]] = {k: [] for k, f in ops.items() if callable(f)}
                for _ in range(reps):  # interleaved: clocks and heat hit every op alike
                    for k in times:
                        times[k].append(time_it(ops[k], iters))  # type: ignore[arg-type]
                row: dict[str, Any] = {"model": model, "layer": layer, "M": M, "K": K, "N": N}
                for k, f in ops.items():
                    row[f"{k}_us"] = round(statistics.median(times[k]) * 1e6, 2) if k in times \
                        else None
                    if not callable(f):
                        row[f"{k}_error"] = f
                for k in ("int8", "fp8"):
                    if row[f"{k}_us"]:
                        row[f"{k}_speedup"] = round(row["bf16_us"] / row[f"{k}_us"], 3)
                row["bf16_tflops"] = round(2 * M * K * N / row["bf16_us"] / 1e6, 2)
                rows.append(row)
                del ops
            del w
    totals: dict[str, dict[str, float]] = {}
    for model in SHAPES:
        for M in ms:
            sel = [r for r in rows if r["model"] == model and r["M"] == M]
            t = {k: sum(r[f"{k}_us"] for r in sel) for k in ("bf16", "int8", "fp8")
                 if all(r[f"{k}_us"] for r in sel)}
            totals[f"{model} M={M}"] = {f"{k}_speedup": round(t["bf16"] / v, 3)
                                        for k, v in t.items() if k != "bf16"}
    summary = "; ".join(f"{k}: " + ", ".join(f"{op.split('_')[0]} {v:.2f}x" for op, v in r.items())
                        for k, r in totals.items())
    return {"device": str(dev), "reps": reps, "fp8_kernel": "_scaled_mm" if dev.type == "cuda"
            else "fp32 emulation", "rows": rows, "layer_sums": totals,
            "summary": f"one layer's 4 linears, speed-up over bf16: {summary}"}


def _graph_case(lin: Any, x: torch.Tensor, whole: bool, g: torch.Generator) -> dict[str, Any]:
    """Capture `lin` (whole forward, or the code product alone on fixed activation codes) in a
    CUDA graph; replay vs eager before and after new codes are copied into the weight buffer."""
    from qurl.quant.formats import quantize_per_token

    fmt = lin.fmt
    xq, xs = quantize_per_token(x, fmt)
    fn = (lambda: lin(x)) if whole else (lambda: lin._code_product(xq) * xs * lin.weight_scale.t())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    graph.replay()
    out = {"before": bool(torch.equal(static, fn()))}
    old = static.clone()
    w = torch.randn(lin.out_features, lin.in_features, generator=g).to(x.device)
    codes, scale = lin.quantize(w)
    ptr = lin.weight.data_ptr()
    lin.load_codes(codes, scale)  # in place: the graph keeps reading the same buffer
    graph.replay()
    torch.cuda.synchronize()
    out.update(after=bool(torch.equal(static, fn())), changed=not bool(torch.equal(static, old)),
               same_buffer=lin.weight.data_ptr() == ptr)
    out["ok"] = out["before"] and out["after"] and out["changed"] and out["same_buffer"]
    return out


def section_cuda_graph(dry: bool) -> dict[str, Any]:
    """int8 (and fp8 where _scaled_mm runs) linears at Qwen2.5-1.5B's gate_up shape, 64 tokens."""
    if not torch.cuda.is_available():
        raise Skip("needs CUDA (graph capture)")
    from qurl.engines.kernels import scaled_mm_available
    from qurl.engines.qlinear import from_linear

    dev, g = torch.device("cuda", 0), torch.Generator().manual_seed(0)
    fmts = ["int8"] + (["fp8"] if scaled_mm_available(dev) else [])
    K, N = SHAPES["qwen2.5-1.5b"]["gate_up"]
    out: dict[str, Any] = {}
    lins = {fmt: from_linear(torch.nn.Linear(K, N, bias=False).to(dev), fmt) for fmt in fmts}
    x = torch.randn(64, K, generator=g).to(dev, torch.bfloat16)
    for whole in (False, True):  # whole forwards last: a failed capture can spoil what follows
        for fmt, lin in lins.items():
            case = f"{fmt}_{'forward' if whole else 'code_product'}"
            try:
                out[case] = _graph_case(lin, x, whole, g)
            except Exception as e:
                out[case] = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
    out["summary"] = ", ".join(f"{k}: " + ("bit-exact after in-place codes" if v["ok"] else
                                           v.get("error", f"NOT exact {v}")) for k, v in out.items())
    return out


def section_engine(dry: bool) -> dict[str, Any]:
    """LocalEngine log-probs (fp32 activations) of the same sequences on the device vs the CPU,
    per precision: bf16 (unquantized), int8 (_int_mm vs FBGEMM), fp8 (_scaled_mm vs emulation)."""
    from qurl.engines.local import LocalEngine
    from qurl.models.hf import build_model

    dev = _device(dry)
    preset, n, prompt, out_len = ("tiny", 2, 8, 16) if dry else ("small", 8, 32, 96)
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"device": str(dev), "preset": preset, "sequences": n}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / preset, preset, seed=0)
        for precision in ("bf16", "int8", "fp8"):
            engines = [LocalEngine(model_dir, precision=precision, dtype=torch.float32, device=d,
                                   seed=0, eos_token_ids=()) for d in ("cpu", dev)]
            if precision == "bf16":
                seqs = [(torch.randint(1, engines[0].vocab_size, (prompt,), generator=g).tolist(),
                         torch.randint(1, engines[0].vocab_size, (out_len,), generator=g).tolist())
                        for _ in range(n)]
            cpu, other = ([e.logprobs(p, o) for p, o in seqs] for e in engines)
            diff = torch.cat([(a - b).abs() for a, b in zip(cpu, other)])
            out[precision] = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
                              "equal": bool(diff.max() == 0), "logp_mean": float(torch.cat(cpu).mean())}
            del engines
    where = "CPU vs CPU" if dev.type == "cpu" else "GPU vs CPU"
    out["summary"] = f"{where} max |d logp|: " + ", ".join(
        f"{p} {out[p]['max_abs']:.2e}" for p in ("bf16", "int8", "fp8"))
    return out
