"""Two learner benchmarks that run whole train steps side by side, arms alternating round by round.

**Attention at the default run's lengths** (`bench_attention_step`): the step `make run` takes —
the `cpu-tiny` config's model, dtype, batch (prompts_per_step x group_size rows) and mini-batches,
rows of a `prompt`-token prompt and rollout.max_new_tokens answer tokens — with SDPA
(qurl/learner/attention.py) and with megatron's unfused attention. Two learners are built from the
same checkpoint; each round steps both, in alternating order. Reported: median train tokens/s per
arm and the median same-round ratio SDPA / unfused.

**A heavy-tailed length mix** (`bench_mix`): `rows` responses with lognormal lengths (median
max/8, capped at the maximum, a fixed prompt in front), one train step per plan per round:
- `sorted`: qurl's plan — rows sorted by length, each micro-batch cut at its longest row's end and
  holding as many rows as the budget allows at that width;
- `arrival`: rows in arrival order, every micro-batch padded to the longest row of the batch and
  holding as many rows as the budget allows at that width.
Both plan against the same memory budget: the GPU rule (membudget.rows_per_micro over the cost
model), with a free-memory figure that holds `budget_rows` rows of the maximum length (the CPU's
fixed logits budget would put every row of this small-vocabulary model in one pass). Useful
tokens/s = loss tokens over the step's wall time; the padding an arm computes is not useful.

Both are benchmarks, not tests: nothing asserts a speed. Numbers are the machine's they ran on.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def _batch(lengths: list[int], prompt: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of `prompt` prompt tokens + lengths[i] loss tokens."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(lengths), prompt + max(lengths)
    tokens = torch.randint(1, vocab, (B, L), generator=g)
    mask = torch.zeros(B, L)
    for i, n in enumerate(lengths):
        mask[i, prompt:prompt + n] = 1
        tokens[i, prompt + n:] = 0
    return {"tokens": tokens, "loss_mask": mask, "behav_logp": -torch.rand(B, L, generator=g) * 3 * mask,
            "adv": torch.randn(B, generator=g)}


def _learner(model_dir: str, dtype: str, mini_batches: int, attention: str, steps: int) -> Any:
    from qurl.config import AlgoConfig, LearnerConfig, ModelConfig, OptimConfig, RanksDeployConfig
    from qurl.learner.megatron import MegatronLearner

    return MegatronLearner(model_dir, ModelConfig(dtype=dtype),
                           AlgoConfig(loss="acr", mini_batches=mini_batches, uaq_scale=1.0),
                           OptimConfig(lr=1e-6), LearnerConfig(tp=1), total_steps=steps, seed=0,
                           ranks=RanksDeployConfig(attention=attention))


def _timed(learner: Any, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    t0 = time.perf_counter()
    stats = learner.train_step(batch["tokens"], batch["loss_mask"], batch["behav_logp"], batch["adv"])
    return time.perf_counter() - t0, stats["tokens"]


def _attention_rounds(rank: int, world: int, model_dir: str, dtype: str, rows: int, mini: int,
                      prompt: int, answer: int, rounds: int, threads: int) -> dict[str, list[float]]:
    from qurl.config import LearnerConfig
    from qurl.learner.dist import init_learner_dist

    torch.set_num_threads(threads)
    init_learner_dist(LearnerConfig(tp=1), rank, world)
    arms = {a: _learner(model_dir, dtype, mini, a, 2 * rounds + 2) for a in ("sdpa", "unfused")}
    vocab = int(arms["sdpa"].hf_config.vocab_size)
    lengths = torch.randint(answer // 4, answer + 1, (rows,), generator=torch.Generator().manual_seed(0))
    batch = _batch(lengths.tolist(), prompt, vocab, seed=1)
    rates: dict[str, list[float]] = {a: [] for a in arms}
    order = list(arms)
    for r in range(rounds + 1):  # round 0: warm-up, not timed
        for arm in order if r % 2 else order[::-1]:
            wall, tokens = _timed(arms[arm], batch)
            if r:
                rates[arm].append(tokens / wall)
    return rates


def bench_attention_step(rounds: int = 5, threads: int = 2, prompt: int = 12) -> dict[str, Any]:
    """Print (and return) train tokens/s of SDPA and unfused attention at the default run's shape."""
    from qurl.config import load_config
    from qurl.learner.dist import spawn
    from qurl.research.bench.engines import resolve_model

    cfg = load_config()
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    with tempfile.TemporaryDirectory(prefix="qurl-bench-attn-") as tmp:
        model_dir = resolve_model(cfg.model.base, Path(tmp))
        rates = spawn(_attention_rounds, 1, str(model_dir), cfg.model.dtype, rows,
                      cfg.algo.mini_batches, prompt, cfg.rollout.max_new_tokens, rounds, threads)[0]
    print(f"learner step at the default run's shape: model {cfg.model.base}, {cfg.model.dtype}, {rows} "
          f"rows of {prompt} prompt + up to {cfg.rollout.max_new_tokens} answer tokens, "
          f"{cfg.algo.mini_batches} mini-batches, {threads} threads, {rounds} rounds (+1 warm-up), CPU")
    out: dict[str, Any] = {}
    for arm, rs in rates.items():
        out[arm] = statistics.median(rs)
        print(f"  {arm:8s} {out[arm]:9.1f} train tokens/s (median)")
    out["sdpa_over_unfused"] = statistics.median(s / u for s, u in zip(rates["sdpa"], rates["unfused"]))
    print(f"  sdpa / unfused (same round, median): {out['sdpa_over_unfused']:.2f}x")
    return out


# ------------------------------------------------------------------ the length mix

def mix_lengths(rows: int, max_len: int, seed: int = 0) -> list[int]:
    """Lognormal response lengths, median max_len / 8 (sigma 1), capped to [1, max_len]."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(rows, generator=g) + torch.log(torch.tensor(max_len / 8)))
    return raw.round().clamp(1, max_len).long().tolist()


def _arrival_plan(learner: Any):
    """Rows in arrival order, each micro-batch padded to the batch's longest row."""
    from qurl.learner import megatron as lm  # its free_bytes: the figure _mix_rounds sets, as
    # the learner's own plan reads it

    def plan(rows: torch.Tensor, ends: torch.Tensor, starts: torch.Tensor | None = None):
        width = int(ends[rows].max())
        n = learner._rows_per_micro(width, lm.agreed_free(lm.free_bytes(learner.device),
                                                          learner.device))
        for i in range(0, len(rows), n):
            idx = rows[i:i + n]
            yield idx, width, 1 if starts is None else max(1, int(starts[idx].min()))
    return plan


def _mix_rounds(rank: int, world: int, model_dir: str, rows: int, max_len: int, prompt: int,
                budget_rows: int, rounds: int, threads: int) -> dict[str, Any]:
    from qurl.config import LearnerConfig
    from qurl.learner import megatron as lm
    from qurl.learner.dist import init_learner_dist

    torch.set_num_threads(threads)
    init_learner_dist(LearnerConfig(tp=1), rank, world)
    learner = _learner(model_dir, "float32", 1, "sdpa", 2 * rounds + 2)
    width = prompt + max_len
    free = int(learner._token_cost.micro_bytes(budget_rows, width) / 0.8) + 1
    lm.free_bytes = lambda device: free  # the GPU rule, with room for budget_rows full rows
    lengths = mix_lengths(rows, max_len)
    batch = _batch(lengths, prompt, int(learner.hf_config.vocab_size), seed=2)
    sorted_plan = learner._micro_batches
    plans = {"sorted": sorted_plan, "arrival": _arrival_plan(learner)}
    passes: dict[str, int] = {}
    rates: dict[str, list[float]] = {a: [] for a in plans}
    order = list(plans)
    for r in range(rounds + 1):  # round 0: warm-up, not timed
        for arm in order if r % 2 else order[::-1]:
            counted: list[int] = []

            def counting(*a: Any, plan=plans[arm], **k: Any):
                parts = list(plan(*a, **k))
                counted.append(len(parts))
                return iter(parts)

            learner._micro_batches = counting
            wall, tokens = _timed(learner, batch)
            passes[arm] = sum(counted)
            if r:
                rates[arm].append(tokens / wall)
    learner._micro_batches = sorted_plan
    return {"rates": rates, "passes": passes, "lengths": lengths}


def bench_mix(model: str = "small", rows: int = 16, max_len: int = 1024, prompt: int = 64,
              budget_rows: int = 4, rounds: int = 2, threads: int = 2) -> dict[str, Any]:
    """Print (and return) useful tokens/s of the sorted and arrival plans on a lognormal mix."""
    from qurl.learner.dist import spawn
    from qurl.research.bench.engines import resolve_model

    with tempfile.TemporaryDirectory(prefix="qurl-bench-mix-") as tmp:
        model_dir = resolve_model(model, Path(tmp))
        r = spawn(_mix_rounds, 1, str(model_dir), rows, max_len, prompt, budget_rows, rounds,
                  threads)[0]
    lengths = sorted(r["lengths"])
    print(f"learner step on a heavy-tailed length mix: model {model}, fp32, {rows} rows of {prompt} "
          f"prompt + lognormal answers (median {lengths[len(lengths) // 2]}, max {lengths[-1]}, "
          f"cap {max_len}; {sum(lengths)} loss tokens), budget {budget_rows} full-length rows per "
          f"micro-batch, {threads} threads, {rounds} rounds (+1 warm-up), CPU")
    out: dict[str, Any] = {}
    for arm, rs in r["rates"].items():
        out[arm] = statistics.median(rs)
        print(f"  {arm:8s} {out[arm]:9.1f} useful tokens/s (median), {r['passes'][arm]} micro-batches")
    out["sorted_over_arrival"] = statistics.median(
        s / a for s, a in zip(r["rates"]["sorted"], r["rates"]["arrival"]))
    print(f"  sorted / arrival (same round, median): {out['sorted_over_arrival']:.2f}x")
    return out
