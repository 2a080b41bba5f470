"""GPU check sections of training: learner (memory vs the cost model), train (+ resume), workers.

Each `section_<name>(dry)` runs in its own process (runner.py) and returns a JSON-able dict with a
one-line "summary"; `dry` = the CPU dry run at tiny sizes. Nothing here asserts: it measures.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qurl.research.bench.gpu_check import Skip

TIMING = ("time/", "tokens_per_s", "sync/time", "wall")  # record keys that differ run to run
# A few-seconds-per-step run: the tiny preset, synthetic sums, a checkpoint after every step.
TRAIN_SETS = {"run.eval_every": 0, "deploy.ckpt_every": 1, "deploy.progress": "false",
              "model.warmstart_steps": 0, "data.train_size": 16, "rollout.prompts_per_step": 4,
              "rollout.group_size": 4, "rollout.max_new_tokens": 16, "eval.max_new_tokens": 16,
              "data.eval_size": 4, "eval.fp_policy": "false", "optim.lr": 1e-3}
DRY_SETS = dict(TRAIN_SETS, **{"data.train_size": 8, "rollout.prompts_per_step": 2,
                               "rollout.group_size": 2, "rollout.max_new_tokens": 6,
                               "eval.max_new_tokens": 6, "data.eval_size": 2})
# the dry run's learner: Qwen2.5-1.5B's layout at toy widths (the real vocabulary takes ~30 s/point)
DRY_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                 num_key_value_heads=2)


def _need(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"{', '.join(missing)} not importable here (bring the wheels: "
                   f"scripts/gpu_wheels.py, then --wheels DIR)")


def _device_or_skip(dry: bool) -> str:
    if torch.cuda.is_available():
        return "cuda"
    if dry:
        return "cpu"
    raise Skip("needs CUDA")


def _build_learner(layers: int, dtype: str, shape: dict[str, Any]) -> Any:
    """A MegatronLearner (TP 1, SDPA attention) over a random Qwen2 of Qwen2.5-1.5B's shapes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qurl.config import AlgoConfig, LearnerConfig, ModelConfig, OptimConfig, RanksDeployConfig
    from qurl.learner.dist import free_port, init_learner_dist
    from qurl.learner.megatron import MegatronLearner
    from qurl.research.bench.learner_long import QWEN25_1P5B

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_learner_dist(LearnerConfig(tp=1), 0, 1)
    cfg = Qwen2Config(num_hidden_layers=layers, architectures=["Qwen2ForCausalLM"],
                      **dict(QWEN25_1P5B, **shape))
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in Qwen2ForCausalLM(cfg).state_dict().items()
             if k != "lm_head.weight"}
    return MegatronLearner(None, ModelConfig(dtype=dtype),
                           AlgoConfig(loss="acr", mini_batches=1, uaq_scale=1.0),
                           OptimConfig(lr=1e-6), LearnerConfig(tp=1, recompute="none"),
                           total_steps=8, seed=0, ranks=RanksDeployConfig(attention="sdpa"),
                           hf_state=state, hf_config=cfg)


def _cuda_step_peak(learner: Any, tokens: torch.Tensor, prompt: int) -> dict[str, float]:
    """learner_long._step_peak on CUDA: the allocator's peak over the memory allocated before the
    step, read as the backward begins (per-row peak) and as the optimizer step begins."""
    B, L = tokens.shape
    mask = torch.zeros(B, L)
    mask[:, min(prompt, L - 1):] = 1
    g = torch.Generator().manual_seed(L)
    behav, adv = -torch.rand(B, L, generator=g) * 3 * mask, torch.randn(B, generator=g)
    opt_step, backward, marks = learner.optimizer.step, torch.Tensor.backward, {}

    def step(*args: Any, **kwargs: Any) -> Any:
        marks.setdefault("step", torch.cuda.max_memory_allocated())
        return opt_step(*args, **kwargs)

    def marked_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        marks.setdefault("forward", torch.cuda.max_memory_allocated())
        backward(self, *args, **kwargs)

    learner.optimizer.step, torch.Tensor.backward = step, marked_backward
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    try:
        learner.train_step(tokens, mask, behav, adv)
        torch.cuda.synchronize()
    finally:
        learner.optimizer.step, torch.Tensor.backward = opt_step, backward
    return {"forward": marks["forward"] - before, "step": marks["step"] - before,
            "wall_s": time.perf_counter() - t0, "tokens": float(mask.sum())}


def section_learner(dry: bool) -> dict[str, Any]:
    """One row per length: measured per-row and step peaks vs the cost model's predictions."""
    _need("megatron", "transformers")
    from qurl.research.bench.learner_long import L0, PROMPT, _step_peak, grad_bytes

    dev = _device_or_skip(dry)
    layers, dtype, shape, lengths = ((1, "float32", DRY_SHAPE, (128, 256)) if dry else
                                     (2, "bfloat16", {}, (2048, 4096, 8192)))
    measure = _cuda_step_peak if dev == "cuda" else _step_peak  # VmHWM on a CPU
    learner = _build_learner(layers, dtype, shape)
    vocab = int(learner.hf_config.vocab_size)
    g = torch.Generator().manual_seed(1)
    measure(learner, torch.randint(0, vocab, (1, L0), generator=g), L0 // 2)  # warm-up
    cost, grads = learner._token_cost, grad_bytes(learner)
    points: dict[str, Any] = {}
    for L in lengths:
        r = measure(learner, torch.randint(0, vocab, (1, L), generator=g), PROMPT)
        pred_row, pred_step = cost.forward_bytes(1, L), grads + cost.micro_bytes(1, L)
        points[str(L)] = {"row_gb": r["forward"] / 1e9, "row_predicted_gb": pred_row / 1e9,
                          "row_ratio": pred_row / max(r["forward"], 1),
                          "step_gb": r["step"] / 1e9, "step_predicted_gb": pred_step / 1e9,
                          "step_ratio": pred_step / max(r["step"], 1),
                          "tokens_per_s": r["tokens"] / r["wall_s"]}
    out = {"device": dev, "dtype": dtype, "layers": layers, "vocab": vocab,
           "hidden": int(learner.hf_config.hidden_size), "points": points,
           "held_gb": torch.cuda.memory_allocated() / 1e9 if dev == "cuda" else None,
           "last_step_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None}
    out["summary"] = (f"{layers} layer(s), vocab {vocab}, {dtype}: per-row peak GB measured / "
                      f"predicted: " + ", ".join(f"L={L} {p['row_gb']:.2f}/{p['row_predicted_gb']:.2f}"
                                                 for L, p in points.items()))
    return out


# `qurl train` with torch's deterministic kernels (warn-only where an op has none): without them a
# GPU's atomics (embedding backward) differ run to run, and no resume could equal a straight run.
DETERMINISTIC = ("import sys, torch; torch.use_deterministic_algorithms(True, warn_only=True); "
                 "from qurl.cli import main; sys.exit(main(sys.argv[1:]))")


def _qurl_train(root: Path, name: str, sets: dict[str, Any], timeout: float,
                resume: bool = False, deterministic: bool = False) -> dict[str, Any]:
    """Run `qurl train` in a subprocess (its output to root/name.log); wall seconds and records."""
    argv = [sys.executable] + (["-c", DETERMINISTIC] if deterministic else ["-m", "qurl.cli"])
    argv += ["train"] + (["--resume", str(root / name)] if resume else [])
    sets = dict(sets, **({} if resume else {"deploy.dir": root, "run.name": name}))
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8") if deterministic else None
    t0 = time.perf_counter()
    log_path = root / f"{name}{'-resume' if resume else ''}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    print(f"qurl train {name}{' --resume' if resume else ''}: exit {proc.returncode} after "
          f"{wall:.1f} s", flush=True)
    if proc.returncode != 0:
        text = log_path.read_text()
        tail = text.strip().splitlines()[-3:]
        print(f"qurl train {name} failed:\n" + text[-4000:])
        raise RuntimeError(f"qurl train {name}{' --resume' if resume else ''} exit "
                           f"{proc.returncode}: {' | '.join(tail)[:300]}")
    from qurl.train.metrics_log import read_metrics

    recs = read_metrics(root / name / "metrics.jsonl")
    return {"wall_s": wall, "train": [r for r in recs if r.get("kind") == "train"]}


def _flat(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, (list, tuple)) else []
    return {k: v for key, val in items for k, v in _flat(val, f"{prefix}/{key}").items()}


def compare_records(a: list[dict], b: list[dict]) -> dict[str, Any]:
    """Exact equality and the largest relative difference of two runs' train records (timing
    keys left out)."""
    a = [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in a]
    b = [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in b]
    worst, where, differ = 0.0, "", set()
    for ra, rb in zip(a, b):
        differ |= {k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)}
        for k in ra.keys() & rb.keys():
            x, y = ra[k], rb[k]
            if isinstance(x, float) and isinstance(y, float) and x != y:
                rel = abs(x - y) / max(abs(x), abs(y), 1e-12)
                if rel > worst:
                    worst, where = rel, f"step {ra.get('step')} {k}"
    return {"records_equal": a == b, "steps": [len(a), len(b)], "max_rel_diff": worst,
            "worst": where, "keys_differing": sorted(differ)}


def section_train(dry: bool) -> dict[str, Any]:
    """`qurl train` 2 steps straight vs 1 step + `--resume` to 2 (deterministic kernels in all
    three): the train records (timings left out) and the step-2 checkpoint's weights compared."""
    _need("megatron", "blake3", "transformers")
    dev = _device_or_skip(dry)
    sets, limit = (DRY_SETS, 200.0) if dry else (TRAIN_SETS, 120.0)
    with tempfile.TemporaryDirectory(prefix="qurl-gpu-train-") as tmp:
        root = Path(tmp)
        straight = _qurl_train(root, "straight", dict(sets, **{"run.steps": 2}), limit, False, True)
        first = _qurl_train(root, "split", dict(sets, **{"run.steps": 1}), limit, False, True)
        resumed = _qurl_train(root, "split", {"run.steps": 2}, limit, True, True)
        out: dict[str, Any] = {"device": dev, "deterministic_kernels": True,
                               **compare_records(straight["train"], resumed["train"])}
        ckpts = {n: sorted(p.name for p in (root / n / "ckpt").glob("step_*"))
                 for n in ("straight", "split")}
        out["checkpoints"] = ckpts
        w = [_flat(torch.load(root / n / "ckpt" / "step_000002" / "model_rank0.pt",
                              map_location="cpu", weights_only=False)) for n in ("straight", "split")]
        out["weights_equal"] = w[0].keys() == w[1].keys() and all(
            torch.equal(w[0][k], w[1][k]) for k in w[0])
        out["weights_max_abs_diff"] = max(
            ((w[0][k].float() - w[1][k].float()).abs().max().item() for k in w[0].keys() & w[1].keys()
             if w[0][k].is_floating_point()), default=0.0)
        out["s_per_step"] = straight["wall_s"] / 2
        out["wall_s"] = {"straight": straight["wall_s"], "split": first["wall_s"],
                         "resume": resumed["wall_s"]}
    exact = out["records_equal"] and out["weights_equal"]
    out["summary"] = (f"{dev}: checkpoints {ckpts['straight']}; resume vs straight: "
                      + ("records and weights bit-equal" if exact else
                         f"NOT bit-equal (records max rel {out['max_rel_diff']:.2e} at "
                         f"{out['worst']}, weights max |d| {out['weights_max_abs_diff']:.2e})"))
    return out


def section_workers(dry: bool) -> dict[str, Any]:
    """`qurl train` 2 steps with deploy.rollout=workers (a worker process per engine, ZeroMQ)."""
    _need("megatron", "blake3", "zmq", "transformers")
    dev = _device_or_skip(dry)
    sets, limit = (DRY_SETS, 200.0) if dry else (TRAIN_SETS, 110.0)
    with tempfile.TemporaryDirectory(prefix="qurl-gpu-workers-") as tmp:
        run = _qurl_train(Path(tmp), "workers", dict(sets, **{"run.steps": 2,
                                                              "deploy.rollout": "workers"}), limit)
    recs = run["train"]
    finite = all(math.isfinite(v) for r in recs for v in r.values() if isinstance(v, float))
    out = {"device": dev, "steps": len(recs), "finite": finite, "wall_s": run["wall_s"],
           "staleness_max": max((r.get("staleness_max", 0.0) for r in recs), default=None),
           "is_ratio_max": max((r.get("is_ratio_max", 0.0) for r in recs), default=None),
           "records": [{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in recs]}
    out["summary"] = (f"{dev}: {len(recs)} steps trained with rollout workers in "
                      f"{run['wall_s']:.0f} s, stats {'finite' if finite else 'NOT finite'}")
    json.dumps(out)  # JSON-able
    return out
