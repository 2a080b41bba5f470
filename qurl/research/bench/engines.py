"""Rollout throughput side by side in one run: the local engine per precision vs transformers `generate`.

`bench_local_engine` takes a model (a preset built with random weights: tiny, small, tiny-qwen3,
tiny-qwen3-moe; a fetched model by name such as `smollm2-135m`; or an HF checkpoint directory),
builds every *arm* once, then times `rounds`
rounds; each round runs every arm once on the same `batch` requests x `new_tokens` sampled tokens
(T = 1, top-p 1; EOS disabled so every request decodes exactly `new_tokens` tokens), the arms'
order rotated each round so that a burst of load on a shared machine does not always hit the same
arm. Per arm it reports the median wall time, tokens/s, tokens per CPU-second (the process's CPU
time: steadier than wall time on an oversubscribed machine), and the median over rounds of the
same-round ratio to each reference arm (`generate`, `bf16` and `fp32` when present: fp32 is the fast full-precision path on CPUs without native bf16). A short untimed
warm-up per arm absorbs one-time costs (kernel selection, allocator growth, weight packing).

Arms (`ARMS`):
- `generate`: transformers `model.generate` on the model in bf16 (sampling, `min_new_tokens` so it
  never stops early), the baseline a user would otherwise reach for;
- `bf16`, `int8`, `fp8`: the local engine with that rollout precision, everything else (embedding,
  head, norms, attention, KV cache) in bf16 compute;
- `fp32`, `int8-fp32`: the engine's "bf16" (unquantized) and int8 precisions with fp32 compute.
On a Qwen3-MoE the engine arms run its sparse MLPs as qurl/engines/moe_block.py does (router in
full precision, experts fused and 8-bit per expert; no w4a16 experts: refused in one line), and
the header names E and top-k. On CPU, int8 is an exact int8 GEMM (FBGEMM where exact, else torch._int_mm) and fp8 the exact fp32
emulation of an E4M3 GEMM (engines/qlinear.py). Threads are pinned to `num_threads` (2 on the CPU
machines) for the run and restored afterwards.

`gemms=True` instead times one decode-step GEMM per kernel for the model's shapes (`bench_gemms`,
CPU time, one thread): which kernel bounds a precision. On a MoE the MLP rows are one expert's
GEMM over the rows routed to it on average (ceil(batch x k / E)).

`profile=True` instead runs each arm once under torch.profiler (a short decode, `new_tokens` as
given) and prints the ops with the most self CPU time: where a decode step's time goes.

This is a benchmark, not a test: nothing asserts a speed.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from qurl.errors import InputError
from qurl.models.hf import MODEL_PRESETS
from qurl.models.moe import route_shape
from qurl.types import GenRequest, SamplingParams

# arm -> (engine precision or None for transformers generate, compute dtype)
ARMS: dict[str, tuple[str | None, torch.dtype]] = {
    "generate": (None, torch.bfloat16),
    "bf16": ("bf16", torch.bfloat16),
    "int8": ("int8", torch.bfloat16),
    "fp8": ("fp8", torch.bfloat16),
    "w4a16": ("w4a16", torch.bfloat16),
    "fp32": ("bf16", torch.float32),
    "int8-fp32": ("int8", torch.float32),
}
PRESETS = tuple(MODEL_PRESETS)  # tiny, small, tiny-qwen3, tiny-qwen3-moe: random weights


def _requests(tok, batch: int, prompt_len: int, new_tokens: int, seed: int) -> list[GenRequest]:
    g = torch.Generator().manual_seed(seed)
    chars = [chr(c) for c in range(0x20, 0x7F)]
    reqs = []
    for i in range(batch):
        text = "".join(chars[j] for j in torch.randint(len(chars), (prompt_len,), generator=g).tolist())
        reqs.append(GenRequest(rid=f"b{i}", prompt_ids=tok.encode(text, add_special_tokens=False),
                               params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=i)))
    return reqs


def resolve_model(model: str, tmp: Path, seed: int = 0) -> Path:
    """A preset name (random weights, built under `tmp`), a fetched model's name, or a checkpoint dir."""
    if model in PRESETS:
        from qurl.models.hf import build_model

        return Path(build_model(tmp / model, model, seed=seed))
    from qurl.models.registry import MODELS, resolve_base

    if model in MODELS or Path(model).is_dir():
        return Path(resolve_base(model))
    raise InputError(f"--preset-model {model!r}: not a preset ({', '.join(PRESETS)}), a fetched "
                     f"model ({', '.join(MODELS)}) or a checkpoint directory")


def _generate_arm(model_dir: Path) -> tuple[Callable[[list[GenRequest]], int], object]:
    """transformers `generate` in bf16 over left-padded requests; returns (run, model)."""
    from qurl.models.hf import load_checkpoint

    model, tok = load_checkpoint(model_dir, dtype=torch.bfloat16)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    @torch.no_grad()
    def run(reqs: list[GenRequest]) -> int:
        plen, n = max(len(r.prompt_ids) for r in reqs), reqs[0].params.max_new_tokens
        ids = torch.full((len(reqs), plen), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            ids[i, plen - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, plen - len(r.prompt_ids):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=pad)
        return int(out[:, plen:].numel())

    return run, model


def _engine_arm(model_dir: Path, precision: str, dtype: torch.dtype, batch: int, seed: int):
    from qurl.engines.local import LocalEngine

    eng = LocalEngine(model_dir, precision=precision, dtype=dtype, seed=seed, max_batch=batch,
                      eos_token_ids=())
    return (lambda reqs: sum(len(r.output_ids) for r in eng.generate(reqs))), eng.model


def _build(arm: str, model_dir: Path, batch: int, seed: int):
    precision, dtype = ARMS[arm]
    if precision is None:
        return _generate_arm(model_dir)
    return _engine_arm(model_dir, precision, dtype, batch, seed)


def _profile(runs: dict, reqs: list[GenRequest], rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    for arm, run in runs.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0, c0 = time.perf_counter(), time.process_time()
            n = run(reqs)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"\n== {arm}: {n} tokens, wall {wall:.2f} s, CPU {cpu:.2f} s (profiler on) ==")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                        max_name_column_width=48))


def _cpu_us(fn: Callable[[], object], reps: int = 9) -> float:
    """Median CPU time of one call in microseconds (thread CPU time: robust to a loaded machine)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    return statistics.median(ts) * 1e6


def bench_gemms(model_dir: Path, batch: int = 32) -> dict[str, dict[str, float]]:
    """CPU time of one decode-step GEMM ([batch, K] x [K, N]) per kernel, for the model's shapes
    (q/k/v fused, o, gate/up fused, down, head): fp32, bf16, int8 torch._int_mm, int8 FBGEMM (the
    split used by Int8Linear, activation halves included), fp8 emulation. One thread."""
    import json

    from qurl.engines.kernels import fbgemm_int8_available, fbgemm_int8_product, fbgemm_pack

    c = json.loads((model_dir / "config.json").read_text())
    h, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    ffn, rows, mlp = c["intermediate_size"], batch, ""
    routes = route_shape(c)
    if routes is not None:  # a MoE: one expert's GEMM over the rows routed to it on average
        _, k_top, n_exp = routes
        ffn, rows, mlp = c["moe_intermediate_size"], -(-batch * k_top // n_exp), "expert "
    shapes = {"qkv": (h, qkv, batch), "o": (c["num_attention_heads"] * hd, h, batch),
              mlp + "gate_up": (h, 2 * ffn, rows), mlp + "down": (ffn, h, rows),
              "head": (h, c["vocab_size"], batch)}
    g = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for name, (k, n, m) in shapes.items():
        a, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        ab, wb = a.bfloat16(), w.bfloat16()
        ai = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
        wi = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        wit, wf8 = wi.t(), w.to(torch.float8_e4m3fn).float().t()
        row = {"fp32": _cpu_us(lambda: a @ w.t()),
               "bf16": _cpu_us(lambda: torch.nn.functional.linear(ab, wb)),
               "int8 _int_mm": _cpu_us(lambda: torch._int_mm(ai, wit)),
               "fp8 emul.": _cpu_us(lambda: ai.float() @ wf8)}
        if fbgemm_int8_available():
            packed, pin = fbgemm_pack(wi), torch.zeros(1, k, dtype=torch.int8)
            pin[0, 0] = 127
            row["int8 fbgemm"] = _cpu_us(lambda: fbgemm_int8_product(ai, packed, pin))
        out[f"{name} {m}x{k}x{n}"] = row
    kernels = list(next(iter(out.values())))
    print(f"CPU microseconds per GEMM, M x K x N, M = {batch} rows (one decode step; a MoE's "
          "experts: the rows routed to one expert on average), 1 thread, median of 9")
    print(f"{'shape':>26} " + " ".join(f"{k:>13}" for k in kernels))
    for name, row in out.items():
        print(f"{name:>26} " + " ".join(f"{row[k]:13.0f}" for k in kernels))
    return out


def _moe_line(model_dir: Path, arms: tuple[str, ...]) -> str:
    """", E experts, top-k" for a Qwen3-MoE ("" for a dense model); an arm whose precision the
    local engine has no MoE experts for (qurl/engines/local.py MOE_PRECISIONS) is an InputError."""
    import json

    from qurl.engines.local import MOE_PRECISIONS

    routes = route_shape(json.loads((model_dir / "config.json").read_text()))
    if routes is None:
        return ""
    bad = [a for a in arms if ARMS[a][0] not in (None, *MOE_PRECISIONS)]
    if bad:
        raise InputError(f"--arms: {bad[0]!r} on a MoE model: the local engine's experts run at "
                         f"{', '.join(MOE_PRECISIONS)} only")
    return f", {routes[2]} experts, top-{routes[1]}"


def bench_local_engine(
    preset: str = "small",
    batch: int = 32,
    new_tokens: int = 128,
    arms: tuple[str, ...] = ("generate", "bf16", "int8", "fp8"),
    *,
    rounds: int = 3,
    prompt_len: int = 16,
    num_threads: int | None = 2,
    seed: int = 0,
    profile: bool = False,
    profile_rows: int = 20,
    gemms: bool = False,
    verbose: bool = True,
) -> dict:
    """Time every arm `rounds` times, interleaved; print a table and return
    {"model", "params", "batch", "new_tokens", "threads", "rounds", "load", "results": {arm: {...}}}."""
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise InputError(f"--arms: unknown arm {bad[0] if bad else '(none)'!r} (known: {', '.join(ARMS)})")
    if rounds < 1:
        raise InputError(f"--rounds must be >= 1, got {rounds}")
    from qurl.models.hf import read_state_dict

    prev = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tmp = tempfile.TemporaryDirectory(prefix="qurl-bench-")
    try:
        model_dir = resolve_model(preset, Path(tmp.name), seed)
        moe = _moe_line(model_dir, arms)
        if gemms:
            torch.set_num_threads(1)
            return {"model": preset, "gemms": bench_gemms(model_dir, batch)}
        # from the checkpoint, not an arm's model: an 8-bit engine holds its codes as buffers
        n_params = sum(t.numel() for t in read_state_dict(model_dir).values())
        runs, tok = {}, None
        for arm in arms:
            runs[arm], _ = _build(arm, model_dir, batch, seed)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        for run in runs.values():  # warm-up: one-time costs stay out of the timed rounds
            run(_requests(tok, min(batch, 4), prompt_len, 2, seed))
        reqs = _requests(tok, batch, prompt_len, new_tokens, seed)
        load0 = os.getloadavg()
        head = (f"model {preset} ({n_params / 1e6:.1f}M params{moe}), batch {batch}, {new_tokens} new "
                f"tokens, prompts {len(reqs[0].prompt_ids)}-{max(len(r.prompt_ids) for r in reqs)} "
                f"tokens, {torch.get_num_threads()} threads")
        if profile:
            print(head + ", profiled")
            _profile(runs, reqs, profile_rows)
            return {"model": preset, "profile": True}
        walls: dict[str, list[float]] = {a: [] for a in arms}
        cpus: dict[str, list[float]] = {a: [] for a in arms}
        tokens: dict[str, int] = {}
        for r in range(rounds):
            order = list(arms[r % len(arms):]) + list(arms[: r % len(arms)])
            for arm in order:
                t0, c0 = time.perf_counter(), time.process_time()
                tokens[arm] = runs[arm](reqs)
                walls[arm].append(time.perf_counter() - t0)
                cpus[arm].append(time.process_time() - c0)
                if verbose:
                    print(f"  round {r + 1} {arm}: wall {walls[arm][-1]:.2f} s, CPU {cpus[arm][-1]:.2f} s, "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)
        load1 = os.getloadavg()
        refs = [a for a in ("generate", "bf16", "fp32") if a in arms]
        results: dict[str, dict[str, float]] = {}
        for arm in arms:
            res = {"seconds": statistics.median(walls[arm]), "cpu_seconds": statistics.median(cpus[arm]),
                   "tokens": float(tokens[arm])}
            res["tokens_per_s"] = tokens[arm] / res["seconds"]
            res["tokens_per_cpu_s"] = tokens[arm] / res["cpu_seconds"]
            for ref in refs:  # same-round ratios of tokens/s, then their median
                res[f"vs_{ref}"] = statistics.median(w_ref / w for w, w_ref in zip(walls[arm], walls[ref]))
                res[f"cpu_vs_{ref}"] = statistics.median(c_ref / c for c, c_ref in zip(cpus[arm], cpus[ref]))
            results[arm] = res
        print(head + f", {rounds} interleaved rounds (medians)")
        print(f"load average (1/5/15 min): start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
              f"end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} on {os.cpu_count()} CPUs")
        cols = "".join(f" {'vs ' + r:>12} {'cpu vs ' + r:>14}" for r in refs)
        print(f"{'arm':>10} {'wall s':>8} {'tokens/s':>9} {'cpu s':>8} {'tok/cpu-s':>10}{cols}")
        for arm, res in results.items():
            cells = "".join(f" {res[f'vs_{r}']:11.2f}x {res[f'cpu_vs_{r}']:13.2f}x" for r in refs)
            print(f"{arm:>10} {res['seconds']:8.2f} {res['tokens_per_s']:9.1f} {res['cpu_seconds']:8.2f} "
                  f"{res['tokens_per_cpu_s']:10.1f}{cells}")
        return {"model": preset, "params": n_params, "batch": batch, "new_tokens": new_tokens,
                "threads": torch.get_num_threads(), "rounds": rounds,
                "load": {"start": load0, "end": load1}, "results": results}
    finally:
        torch.set_num_threads(prev)
        tmp.cleanup()
