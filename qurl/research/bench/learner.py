"""A learner step side by side: the LM head on the loss columns only vs on every position.

`bench_learner` builds one MegatronLearner (TP 1, fp32, one spawned rank) on a model (a preset with
random weights, a fetched model such as `smollm2-135m`, or a checkpoint directory), and a batch
shaped like an RL step: `rows` sequences of a `prompt`-token prompt and a `response`-token answer
(the loss mask covers the answer), two mini-batches, random advantages. Each round runs two
`train_step`s, one per arm, in alternating order:

- `cut`: what the learner does (qurl/learner/logits.py): the head from each micro-batch's first
  loss column on;
- `whole`: the head on every position, as before head.py (the learner's first-loss-column
  function replaced by zeros for that step).

Both arms step the same learner, so the weights move between steps; the time of a step does not
depend on the weights' values. Reported per arm: the median wall time and CPU time (the process's,
steadier than wall time on a shared machine), and the median over rounds of the same-round ratio
whole / cut. This is a benchmark, not a test: nothing asserts a speed.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qurl.research.bench.engines import resolve_model


def _round_robin(rank: int, world: int, model_dir: str, rows: int, prompt: int, response: int,
                 rounds: int, threads: int) -> dict[str, Any]:
    from qurl.config import AlgoConfig, LearnerConfig, ModelConfig, OptimConfig
    from qurl.learner import megatron as lm
    from qurl.learner.dist import init_learner_dist

    torch.set_num_threads(threads)
    init_learner_dist(LearnerConfig(tp=1), rank, world)
    learner = lm.MegatronLearner(model_dir, ModelConfig(dtype="float32"),
                                 AlgoConfig(loss="acr", mini_batches=2, uaq_scale=1.0),
                                 OptimConfig(lr=1e-6), LearnerConfig(tp=1), total_steps=rounds * 2,
                                 seed=0)
    vocab = int(learner.hf_config.vocab_size)
    g = torch.Generator().manual_seed(0)
    L = prompt + response
    tokens = torch.randint(0, vocab, (rows, L), generator=g)
    mask = torch.zeros(rows, L, dtype=torch.bool)
    mask[:, prompt:] = True
    behav = -torch.rand(rows, L, generator=g) * 3 * mask
    adv = torch.randn(rows, generator=g)
    cut = lm.first_loss_columns

    def whole(m: torch.Tensor) -> torch.Tensor:
        return torch.zeros(m.shape[0], dtype=torch.long, device=m.device)

    times: dict[str, list[tuple[float, float]]] = {"cut": [], "whole": []}
    order = ["cut", "whole"]
    try:
        for r in range(rounds + 1):  # round 0: warm-up, not timed
            for arm in order if r % 2 else order[::-1]:
                lm.first_loss_columns = cut if arm == "cut" else whole
                w0, c0 = time.perf_counter(), time.process_time()
                stats = learner.train_step(tokens, mask, behav, adv)
                if r:
                    times[arm].append((time.perf_counter() - w0, time.process_time() - c0))
                if stats["tokens"] != float(mask.sum()):
                    raise RuntimeError(f"{arm}: step saw {stats['tokens']} loss tokens")
    finally:
        lm.first_loss_columns = cut
    return times


def bench_learner(model: str = "smollm2-135m", rows: int = 16, prompt: int = 94, response: int = 24,
                  rounds: int = 2, threads: int = 2) -> dict[str, Any]:
    """Print (and return) the per-arm step times and the whole/cut ratio (module docstring)."""
    from qurl.learner.dist import spawn

    with tempfile.TemporaryDirectory(prefix="qurl-bench-learner-") as tmp:
        model_dir = resolve_model(model, Path(tmp))
        times = spawn(_round_robin, 1, str(model_dir), rows, prompt, response, rounds, threads)[0]
    print(f"learner step, model {model}: {rows} rows of {prompt} prompt + {response} answer "
          f"tokens, 2 mini-batches, fp32, {threads} threads, {rounds} rounds (+1 warm-up)")
    out: dict[str, Any] = {}
    for arm, ts in times.items():
        wall = statistics.median(t[0] for t in ts)
        cpu = statistics.median(t[1] for t in ts)
        out[arm] = {"wall_s": wall, "cpu_s": cpu}
        print(f"  {arm:6s} wall {wall:7.2f} s   cpu {cpu:7.2f} s")
    for i, key in enumerate(("wall", "cpu")):
        ratio = statistics.median(w[i] / c[i] for w, c in zip(times["whole"], times["cut"]))
        out[f"whole_over_cut_{key}"] = ratio
        print(f"  whole / cut ({key}, same round, median): {ratio:.2f}x")
    return out
