"""The learner at long lengths, measured: peak memory per row and train tokens/s against L, arms side
by side; and the micro-batch plan on a heavy-tailed length mix.

**Memory sweep** (`bench_memory`). The model is random, with Qwen2.5-1.5B's layer shapes and its
151,936-token vocabulary (hidden 1,536, FFN 8,960, 12 heads, 2 KV heads, tied embeddings), cut to
`layers` layers, fp32 (CPU). Each point (arm, L) runs in a fresh process (`spawn`, one rank):

1. build the learner and take one warm-up `train_step` at a short width L0 (allocates the
   optimizer state and every lazily made buffer);
2. take a step of one row at width L (a 64-token prompt, the rest loss) and read the peak resident
   memory (Linux VmHWM, reset before the step through /proc/self/clear_refs) over the resident set
   just before the step, twice: as the backward begins (the **per-row peak**: what the forward
   keeps for the backward plus its largest transient; no gradient exists yet) and as the optimizer
   step begins (the **step peak**: gradients, the backward's rebuilt layers and head chunks too).
   glibc is set to return freed memory (every allocation over 64 KiB mapped on its own, free heap
   trimmed before the step), so the resident set follows live tensors;
3. beside each, the cost model's prediction (qurl/learner/membudget.py): `forward_bytes(1, L)`
   for the per-row peak; `grad_bytes + micro_bytes(1, L)` for the step peak — an upper bound, as
   the planner uses it: the backward frees activations while it allocates gradients, so the real
   peak is below the sum.

Arms: `unfused` (megatron's DotProductAttention), `sdpa` (qurl/learner/attention.py), `sdpa+full`
(and `sdpa+selective`: megatron's activation recompute). A point the cost model prices above
`max_gb` is skipped, saying so (the unfused arm at 8k would hold ~10 GB of scores per layer here).
Tokens/s = loss tokens of the L step over its wall time.

**Length mix** (`bench_mix`). `rows` responses with lognormal lengths (median max/8, capped at the
maximum), one train step per plan, alternating over `rounds`:
- `sorted`: qurl's plan — rows sorted by length, each micro-batch cut at its longest row's end and
  holding as many rows as the budget allows at that width;
- `arrival`: rows in arrival order, each micro-batch padded to the longest row of the whole batch
  and holding as many rows as the budget allows at that width.
Useful tokens/s = loss tokens over wall time (padding computed is not useful). On CPU the budget is
the fixed logits budget (qurl/learner/megatron.py LOGITS_BUDGET).

Numbers are the machine's they ran on (printed with it): a CPU run is not a GPU run.
"""
from __future__ import annotations

import platform
import re
import time
from pathlib import Path
from typing import Any

import torch

ARMS = {"unfused": ("unfused", "none"), "sdpa": ("sdpa", "none"),
        "sdpa+selective": ("sdpa", "selective"), "sdpa+full": ("sdpa", "full")}
QWEN25_1P5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                   num_attention_heads=12, num_key_value_heads=2, rope_theta=1e6,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768)
L0 = 64
PROMPT = 64


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _exact_rss() -> None:
    """Make the resident set follow live memory: glibc serves every allocation over 64 KiB by mmap
    (returned at free; its default threshold grows to 32 MiB, and freed heap memory stays
    resident) and gives back free heap memory now."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD (fixed: no dynamic growth)
    libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    libc.malloc_trim(0)


def _step_peak(learner: Any, tokens: torch.Tensor, prompt: int) -> dict[str, float]:
    """One train step of `tokens`: the peak resident memory of its forward (VmHWM read as the
    backward begins) and of its forward + backward (read as the optimizer step begins), each over
    the resident set before the step; wall seconds; loss tokens. The optimizer's own transients
    (flat fp32 gradients, AdamW temporaries) do not depend on L and are left out."""
    B, L = tokens.shape
    mask = torch.zeros(B, L)
    mask[:, min(prompt, L - 1):] = 1
    g = torch.Generator().manual_seed(L)
    behav = -torch.rand(B, L, generator=g) * 3 * mask
    adv = torch.randn(B, generator=g)
    opt_step, backward, marks = learner.optimizer.step, torch.Tensor.backward, {}

    def step(*args: Any, **kwargs: Any) -> float:
        marks.setdefault("step", _kib("VmHWM"))
        return opt_step(*args, **kwargs)

    def marked_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        marks.setdefault("forward", _kib("VmHWM"))
        backward(self, *args, **kwargs)

    learner.optimizer.step, torch.Tensor.backward = step, marked_backward
    _exact_rss()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _kib("VmRSS")
    t0 = time.perf_counter()
    try:
        learner.train_step(tokens, mask, behav, adv)
    finally:
        learner.optimizer.step, torch.Tensor.backward = opt_step, backward
    wall = time.perf_counter() - t0
    return {"forward": marks["forward"] - before, "step": marks["step"] - before, "wall_s": wall,
            "tokens": float(mask.sum())}


def build_random(layers: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], Any]:
    """(HF state dict, config) of a random Qwen2 model of Qwen2.5-1.5B's shapes with `layers`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(num_hidden_layers=layers, architectures=["Qwen2ForCausalLM"], **QWEN25_1P5B)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return state, cfg


def _point(rank: int, world: int, arm: str, L: int, layers: int, threads: int) -> dict[str, Any]:
    from qurl.config import AlgoConfig, LearnerConfig, ModelConfig, OptimConfig, RanksDeployConfig
    from qurl.learner.dist import init_learner_dist
    from qurl.learner.megatron import MegatronLearner

    torch.set_num_threads(threads)
    attention, recompute = ARMS[arm]
    init_learner_dist(LearnerConfig(tp=1), rank, world)
    state, cfg = build_random(layers)
    learner = MegatronLearner(None, ModelConfig(dtype="float32"),
                              AlgoConfig(loss="acr", mini_batches=1, uaq_scale=1.0),
                              OptimConfig(lr=1e-6), LearnerConfig(tp=1, recompute=recompute),
                              total_steps=3, seed=0, ranks=RanksDeployConfig(attention=attention),
                              hf_state=state, hf_config=cfg)
    del state
    g = torch.Generator().manual_seed(1)
    _step_peak(learner, torch.randint(0, cfg.vocab_size, (1, L0), generator=g), L0 // 2)  # warm-up
    r = _step_peak(learner, torch.randint(0, cfg.vocab_size, (1, L), generator=g), PROMPT)
    cost = learner._token_cost
    return {"row": r["forward"], "row_predicted": cost.forward_bytes(1, L),
            "step": r["step"], "step_predicted": grad_bytes(learner) + cost.micro_bytes(1, L),
            "tokens_per_s": r["tokens"] / r["wall_s"], "wall_s": r["wall_s"]}


def grad_bytes(learner: Any) -> float:
    """The cost model's gradient bytes of this learner rank (membudget.grad_bytes)."""
    from qurl.learner.membudget import grad_bytes as cost

    params = sum(p.numel() for p in learner.model.parameters())
    tied = learner._local_vocab * int(learner.hf_config.hidden_size) \
        if learner.hf_config.tie_word_embeddings else 0
    return cost(params, learner._token_cost.elem, tied)


def predicted_row_bytes(arm: str, L: int, layers: int) -> float:
    """The cost model's bound on one row's step (`micro_bytes`) for one arm at width L (fp32, TP 1)
    for this benchmark's model: what a point is skipped by."""
    from qurl.learner.memory_plan import token_cost_from_fields

    attention, recompute = ARMS[arm]
    fields = dict(QWEN25_1P5B, num_hidden_layers=layers, architectures=["Qwen2ForCausalLM"])
    return token_cost_from_fields(fields, tp=1, elem=4, recompute=recompute,
                                  attention="flash" if attention == "sdpa" else "unfused"
                                  ).micro_bytes(1, L)


def bench_memory(lengths: tuple[int, ...] = (1024, 2048, 4096, 8192),
                 arms: tuple[str, ...] = ("unfused", "sdpa", "sdpa+full"), layers: int = 2,
                 threads: int = 2, max_gb: float = 12.0) -> dict[str, dict[int, dict[str, Any]]]:
    """Print (and return) per arm and L: measured and predicted per-row peak, tokens/s."""
    from qurl.learner.dist import spawn

    for arm in arms:
        if arm not in ARMS:
            raise ValueError(f"arm {arm!r}: choose from {', '.join(ARMS)}")
    print(f"learner memory per row vs L: random Qwen2.5-1.5B shapes (vocab 151,936), {layers} layers, "
          f"fp32, TP 1, {threads} threads, one row (64-token prompt, rest loss); "
          f"machine: {platform.machine()} CPU, {torch.get_num_threads()} torch threads available")
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for arm in arms:
        out[arm] = {}
        for L in lengths:
            want = predicted_row_bytes(arm, L, layers) / 1e9
            if want > max_gb:
                print(f"  {arm:15s} L={L:6d}  skipped: the cost model prices it at {want:.1f} GB "
                      f"> --max-gb {max_gb}")
                continue
            r = spawn(_point, 1, arm, L, layers, threads)[0]
            out[arm][L] = r
            print(f"  {arm:15s} L={L:6d}  per row {r['row'] / 1e9:6.2f} GB, predicted "
                  f"{r['row_predicted'] / 1e9:6.2f} ({r['row_predicted'] / r['row']:.2f}x)   step "
                  f"{r['step'] / 1e9:6.2f} GB, predicted {r['step_predicted'] / 1e9:6.2f} "
                  f"({r['step_predicted'] / r['step']:.2f}x)   {r['tokens_per_s']:6.1f} train tokens/s",
                  flush=True)
    for arm, pts in out.items():
        Ls = sorted(pts)
        growth = [f"{a}->{b}: {pts[b]['row'] / pts[a]['row']:.2f}x"
                  for a, b in zip(Ls, Ls[1:]) if b == 2 * a]
        if growth:
            print(f"  {arm}: per-row peak growth per doubling of L  " + ", ".join(growth))
    base = out.get("unfused", {})
    for arm, pts in out.items():
        if arm != "unfused":
            for L in sorted(set(pts) & set(base)):
                print(f"  {arm} / unfused at L={L}: per-row memory "
                      f"{pts[L]['row'] / base[L]['row']:.2f}x, train tokens/s "
                      f"{pts[L]['tokens_per_s'] / base[L]['tokens_per_s']:.2f}x")
    return out
