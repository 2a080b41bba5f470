"""One-GPU check of qurl's GPU path (`scripts/gpu_check.sh`; budget: 8 minutes on one H200).

Prints one table:
1. Megatron learner on the GPU (NCCL, TP 1; Transformer Engine layer spec when transformer_engine
   imports, megatron's local spec otherwise — the table says which), on the `small` Qwen2
   preset (~104M): logits parity against `transformers` (fp32 both sides; max |diff| relative to
   max |logit|, must be < 1e-3), then a few QuRL train steps in bf16 with fp32 master weights
   (tokens/s over forward + backward + optimizer, after one warm-up step).
2. Local engine on a ~1B-parameter random Qwen2 config (hidden 2048, 16 layers, FFN 8192), bf16
   activations: generated tokens/s for bf16 weights vs W8A8 FP8 (torch._scaled_mm, per-token x
   per-channel scales) vs W8A8 INT8 (torch._int_mm), same prompts, same batch.
3. Real SGLang servers (only where `import sglang` works, e.g. the Docker image; skipped and
   said so otherwise): for each of int8 (`w8a8_int8`), fp8 (`w8a8_fp8`) and fp8_block (`fp8`), a
   3-step `qurl train` with rollout.engine=sglang on the `small` preset: qurl exports the 8-bit
   checkpoint, launches the server with the flags it plans (`--custom-weight-loader` for W8A8),
   and every step syncs the learner's 8-bit codes over NCCL. Per precision: the engine-vs-learner
   mismatch KL(behav||prox) and max pi_prox/pi_behav over the steps, the flip fraction, and s/step.
Nothing here is a test assertion: it measures and reports; the exit code is 1 only when parity
fails or CUDA is missing. Run it, paste the table; never quote numbers that were not measured.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

BIG = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
           intermediate_size=8192, max_position_embeddings=2048)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def check_learner(tmp: Path, preset: str = "small", batch: int = 16, seq: int = 256,
                  steps: int = 3, device: str = "cuda") -> dict[str, float]:
    """Parity vs transformers and train-step tokens/s of MegatronLearner on cuda:0 (device "cpu"
    only to smoke-test this script: gloo, fp32)."""
    from transformers import AutoModelForCausalLM

    from qurl.config import AlgoConfig, DeployConfig, LearnerConfig, ModelConfig, OptimConfig
    from qurl.learner.dist import free_port, init_learner_dist
    from qurl.learner.megatron import MegatronLearner
    from qurl.models.hf import build_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    lc = LearnerConfig(tp=1)
    dc = DeployConfig(backend="nccl" if device == "cuda" else "gloo")
    init_learner_dist(lc, 0, 1, deploy=dc)
    model_dir = build_model(tmp / preset, preset, seed=0)
    algo = AlgoConfig(uaq_scale=1.0, mini_batches=2)
    out: dict[str, float] = {}

    g = torch.Generator().manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    vocab = int(ref.config.vocab_size)
    tokens = torch.randint(0, vocab, (4, 128), generator=g)
    learner = MegatronLearner(model_dir, ModelConfig(dtype="float32"), algo, OptimConfig(), lc,
                              total_steps=steps + 1, seed=0, deploy=dc)
    with torch.no_grad():
        want = ref(tokens.to(device)).logits.float()
        got = learner.logits(tokens).to(device)
    out["parity_rel"] = float((got - want).abs().max() / want.abs().max())
    out["te"] = float(learner.te)
    out["params_M"] = sum(p.numel() for p in ref.parameters()) / 1e6
    del learner, ref
    if device == "cuda":
        torch.cuda.empty_cache()

    dtype = "bfloat16" if device == "cuda" else "float32"
    learner = MegatronLearner(model_dir, ModelConfig(dtype=dtype), algo,
                              OptimConfig(lr=1e-5), lc, total_steps=steps + 1, seed=0, deploy=dc)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[:, : seq // 4] = False  # the prompt part
    adv = torch.randn(batch, generator=g)
    times = []
    for _ in range(steps + 1):
        behav = learner.logprobs(tokens).cpu()
        _sync(device)
        t0 = time.perf_counter()
        stats = learner.train_step(tokens, mask, behav, adv)
        _sync(device)
        times.append(time.perf_counter() - t0)
    out["train_tok_s"] = batch * seq / (sum(times[1:]) / steps)
    out["train_finite"] = float(all(v == v for v in stats.values()))  # NaN != NaN
    del learner
    return out


def check_engine(tmp: Path, overrides: dict | None = None, batch: int = 64, prompt: int = 64,
                 new_tokens: int = 128, device: str = "cuda") -> dict[str, float]:
    """Generated tokens/s of LocalEngine (bf16 compute) with bf16 / fp8 / int8 weights."""
    from qurl.engines.kernels import scaled_mm_available
    from qurl.engines.local import LocalEngine
    from qurl.models.hf import build_model
    from qurl.types import GenRequest, SamplingParams

    model_dir = build_model(tmp / "big", "small", seed=0, overrides=overrides or BIG)
    g = torch.Generator().manual_seed(1)
    out: dict[str, float] = {"scaled_mm": float(scaled_mm_available(torch.device(device)))}
    for precision in ("bf16", "fp8", "int8"):
        eng = LocalEngine(model_dir, precision=precision, dtype=torch.bfloat16, device=device,
                          seed=0, max_batch=batch, eos_token_ids=())
        if precision == "bf16":
            out["params_B"] = sum(p.numel() for p in eng.model.parameters()) / 1e9
            vocab = eng.vocab_size
            prompts = [torch.randint(1, vocab, (prompt,), generator=g).tolist()
                       for _ in range(batch)]
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
        reqs = [GenRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
        eng.generate(reqs[:4])  # warm-up: kernels, allocator
        _sync(device)
        t0 = time.perf_counter()
        res = eng.generate(reqs)
        _sync(device)
        dt = time.perf_counter() - t0
        out[f"{precision}_tok_s"] = sum(r.output_ids.numel() for r in res) / dt
        del eng
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def check_sglang(tmp: Path, precisions: tuple[str, ...] = ("int8", "fp8", "fp8_block"),
                 steps: int = 3) -> dict[str, dict[str, float]]:
    """Per precision: mismatch and timing of a short `qurl train` against real SGLang servers."""
    import json
    import subprocess
    import sys

    out: dict[str, dict[str, float]] = {}
    for precision in precisions:
        name = f"sglang-{precision}"
        sets = [f"deploy.dir={tmp}", f"run.name={name}", f"run.steps={steps}", "run.eval_every=0",
                "deploy.ckpt_every=0", "deploy.progress=false", "model.base=small",
                "model.warmstart_steps=0", "data.eval_size=32", "rollout.engine=sglang",
                f"rollout.precision={precision}", "rollout.prompts_per_step=16",
                "sglang.args=--mem-fraction-static,0.3"]
        argv = [sys.executable, "-m", "qurl.cli", "train"] + [a for kv in sets for a in ("--set", kv)]
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=420)
        if proc.returncode != 0:
            out[precision] = {"failed": 1.0}
            print(f"[sglang {precision}] failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            continue
        recs = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in recs if r.get("kind") == "train"]
        out[precision] = {
            "kl": max(r["kl_behav_prox"] for r in train),
            "ratio_max": max(r["is_ratio_max"] for r in train),
            "flip": sum(r.get("flip_frac", 0.0) for r in train) / len(train),
            "s_per_step": (time.perf_counter() - t0) / steps}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qurl.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-learner", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-sglang", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing measured")
        return 1
    t_start = time.perf_counter()
    rows: list[tuple[str, str]] = [("device", torch.cuda.get_device_name(0)),
                                   ("torch", torch.__version__)]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_learner:
            r = check_learner(Path(tmp))
            ok = r["parity_rel"] < 1e-3 and r["train_finite"] == 1.0
            rows += [("learner: layer spec", "Transformer Engine" if r["te"] else "megatron local"),
                     (f"learner: logits parity vs transformers ({r['params_M']:.0f}M, fp32)",
                      f"{r['parity_rel']:.2e} max|diff|/max|logit| "
                      f"{'PASS' if r['parity_rel'] < 1e-3 else 'FAIL'}"),
                     ("learner: train step tokens/s (bf16, fp32 master)",
                      f"{r['train_tok_s']:,.0f}" + ("" if r["train_finite"] else " (NaN stats!)"))]
        if not args.skip_engine:
            r = check_engine(Path(tmp))
            rows += [(f"engine ({r['params_B']:.2f}B): bf16 tokens/s", f"{r['bf16_tok_s']:,.0f}"),
                     ("engine: fp8 tokens/s (torch._scaled_mm)" if r["scaled_mm"] else
                      "engine: fp8 tokens/s (EMULATED: no _scaled_mm)", f"{r['fp8_tok_s']:,.0f}"),
                     ("engine: int8 tokens/s (torch._int_mm)", f"{r['int8_tok_s']:,.0f}"),
                     ("engine: fp8 / bf16", f"{r['fp8_tok_s'] / r['bf16_tok_s']:.2f}x"),
                     ("engine: int8 / bf16", f"{r['int8_tok_s'] / r['bf16_tok_s']:.2f}x")]
        if not args.skip_sglang:
            import importlib.util

            if importlib.util.find_spec("sglang") is None:
                rows.append(("sglang", "not installed here: real-server check skipped"))
            else:
                for prec, r in check_sglang(Path(tmp)).items():
                    rows.append((f"sglang {prec}: KL(behav||prox) max / ratio max / flip / s/step",
                                 "FAILED (log above)" if "failed" in r else
                                 f"{r['kl']:.2e} / {r['ratio_max']:.3f} / {r['flip']:.2%} / "
                                 f"{r['s_per_step']:.1f}"))
    rows.append(("wall time", f"{time.perf_counter() - t_start:.0f} s"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
