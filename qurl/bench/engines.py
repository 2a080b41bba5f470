"""Throughput of the local engine per precision, measured side by side in one run.

`bench_local_engine` builds a randomly initialised model of the given preset (weights do not change
the cost of a forward), then for each precision constructs a `LocalEngine` and times one `generate`
of `batch` requests x `new_tokens` sampled tokens (EOS disabled, so every request decodes exactly
`new_tokens` tokens; prompts are `prompt_len` random characters). A short untimed warm-up call per
engine absorbs one-time costs (kernel selection, allocator growth). Reported: generated tokens per
second of wall time (prefill included) and the ratio to the first precision. Threads are pinned to
`num_threads` (2 on the CPU machines) for the run and restored afterwards.

This is a benchmark, not a test: nothing asserts a speed. On CPU, "bf16" means full-precision
weights in `dtype` (float32 by default), "int8" uses torch._int_mm on int8 codes, "fp8" the fp32
emulation (see engines/qlinear.py).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from qurl.engines.local import LocalEngine
from qurl.models.hf import build_model, param_count
from qurl.types import GenRequest, SamplingParams


def _requests(tok, batch: int, prompt_len: int, new_tokens: int, seed: int) -> list[GenRequest]:
    g = torch.Generator().manual_seed(seed)
    chars = [chr(c) for c in range(0x20, 0x7F)]
    reqs = []
    for i in range(batch):
        text = "".join(chars[j] for j in torch.randint(len(chars), (prompt_len,), generator=g).tolist())
        reqs.append(GenRequest(rid=f"b{i}", prompt_ids=tok.encode(text, add_special_tokens=False),
                               params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=i)))
    return reqs


def bench_local_engine(
    preset: str = "small",
    batch: int = 32,
    new_tokens: int = 128,
    precisions: tuple[str, ...] = ("bf16", "int8"),
    *,
    prompt_len: int = 16,
    num_threads: int | None = 2,
    dtype: torch.dtype = torch.float32,
    model_dir: str | Path | None = None,
    seed: int = 0,
) -> dict:
    """Time `generate` per precision; print a table and return
    {"preset", "params", "batch", "new_tokens", "threads", "dtype", "results": {precision: {...}}}."""
    prev = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tmp = None
    try:
        if model_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="qurl-bench-")
            model_dir = build_model(Path(tmp.name) / preset, preset, seed=seed)
        results: dict[str, dict[str, float]] = {}
        n_params = 0
        for prec in precisions:
            eng = LocalEngine(model_dir, precision=prec, dtype=dtype, seed=seed, max_batch=batch,
                              eos_token_ids=())
            n_params = n_params or param_count(eng.model)
            eng.generate(_requests(eng.tokenizer, min(batch, 4), prompt_len, 2, seed))  # warm-up
            reqs = _requests(eng.tokenizer, batch, prompt_len, new_tokens, seed)
            t0 = time.perf_counter()
            out = eng.generate(reqs)
            dt = time.perf_counter() - t0
            n = sum(len(r.output_ids) for r in out)
            results[prec] = {"seconds": dt, "tokens": float(n), "tokens_per_s": n / dt}
            del eng
        base = results[precisions[0]]["tokens_per_s"]
        print(f"local engine, preset {preset} ({n_params / 1e6:.1f}M params), batch {batch}, "
              f"{new_tokens} new tokens, {torch.get_num_threads()} threads, compute dtype {dtype}")
        print(f"{'precision':>10} {'seconds':>9} {'tokens/s':>10} {'vs ' + precisions[0]:>9}")
        for prec, r in results.items():
            print(f"{prec:>10} {r['seconds']:9.2f} {r['tokens_per_s']:10.1f} {r['tokens_per_s'] / base:8.2f}x")
        return {"preset": preset, "params": n_params, "batch": batch, "new_tokens": new_tokens,
                "threads": torch.get_num_threads(), "dtype": str(dtype), "results": results}
    finally:
        torch.set_num_threads(prev)
        if tmp is not None:
            tmp.cleanup()
