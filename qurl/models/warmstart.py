"""Supervised warm start: a short fine-tune on (prompt, worked solution) pairs before RL.

RL from verifiable rewards only learns from groups where some samples are right, so a randomly
initialised tiny model would see no signal. This module teaches it the answer format and some skill
by plain next-token training on worked solutions, producing the "warm-started base model" RL starts
from.

Objective: mean cross-entropy over completion tokens plus the final EOS (the prompt and padding
are masked out), i.e. for pair (p, c) with c' = c + [eos]:  -1/N sum_t log pi(c'_t | p, c'_<t),
N = total completion tokens in the batch. Optimiser: torch AdamW (betas 0.9/0.95, no weight decay),
linear warm-up over the first 10% of steps then cosine decay to 10% of `lr`, grad-norm clip 1.0.

Why not the learner's optimizer. The learning-rate curve is the learner's own function,
qurl/algo/schedule.py `warmup_then_decay` (which qurl/learner/optim.py `lr_at` runs with floor 0;
here warm-up = a tenth of the steps, floor = a tenth): the same values, to the bit, as this module's
formula before it was shared. The update cannot be: the learner's `DistributedAdamW`
(qurl/learner/distopt.py) is not tied to Megatron (it takes any parameters, on one process), but it
runs torch's fused AdamW over flat fp32 buffers and clips by a float64 grad norm, applied only when
the coefficient is below 1, where this is torch's per-tensor AdamW after `clip_grad_norm_` (a
float32 norm). Same math on paper, other roundings: on the tiny model, the same gradients, betas,
eps and lr leave 42 of its 50 tensors different after one unclipped step (by up to 6e-8), and all 50
after six clipped ones. A built base is cached under a key of its recipe (qurl/models/base.py
`_base_key`), which existing caches, and the run directories built from them, hold; a base rebuilt
by the learner's optimizer under the same key would be another model. Moving the warm start onto
it is a change of results, to make with a new cache key, not a refactoring.

Determinism: batches are drawn from epoch-wise permutations of a generator seeded by `seed`, and
the model has no dropout, so the same inputs, seed and thread count give bitwise the same weights.
The run uses `num_threads` torch threads (2 by default, what the CPU machines give one job) and
restores the caller's setting afterwards.

Precision: by default the forward runs with bf16 matmuls (autocast); master weights, optimizer
state, loss and the saved checkpoint stay fp32. On CPUs with native bf16 matmul (AVX512-BF16 / AMX,
detected through oneDNN) that is `torch.autocast(bfloat16)`, about 2x faster than fp32 on 2 cores.
Elsewhere the same rounding is computed with fp32 kernels (qurl/models/bf16_emulated.py), because
autocast's own fallback there is ~9x slower than fp32. The rounding is not a detail: SmolLM2's warm
start trained in fp32 instead is another model (seed 4: loss 0.0097 vs 0.072 after 20 steps, 88% vs
47% held-out Avg@4 before RL; docs/study/smollm2_regime.md), so every CPU builds the bf16 kind.
`warmstart.json` records which ("bf16_matmul": native / emulated). Pass `bf16_autocast=False` for
a pure fp32 run.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from qurl.algo.schedule import warmup_then_decay
from qurl.models.bf16_emulated import EmulatedBf16Autocast
from qurl.models.hf import load_checkpoint


def _encode(tok, pairs: list[tuple[str, str]], max_len: int) -> list[tuple[list[int], int]]:
    """Each pair -> (prompt ids + completion ids + eos, prompt length); over-long ones are refused."""
    out = []
    for i, (prompt, completion) in enumerate(pairs):
        p = tok.encode(prompt, add_special_tokens=False)
        c = tok.encode(completion, add_special_tokens=False) + [tok.eos_token_id]
        if not p:
            raise ValueError(f"pairs[{i}]: empty prompt")
        if len(p) + len(c) > max_len:
            raise ValueError(f"pairs[{i}]: {len(p) + len(c)} tokens exceed the model's {max_len} positions")
        out.append((p + c, len(p)))
    return out


def _batch(encoded: list[tuple[list[int], int]], idx: list[int], pad_id: int):
    """Right-padded input_ids, attention_mask [B, L] and labels [B, L] (-100 = not a target)."""
    length = max(len(encoded[i][0]) for i in idx)
    ids = torch.full((len(idx), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, i in enumerate(idx):
        seq, plen = encoded[i]
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, plen : len(seq)] = torch.tensor(seq[plen:])
    return ids, mask, labels


def _loss(model, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    target = labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100
    )


@torch.no_grad()
def completion_loss(model, tokenizer, pairs: list[tuple[str, str]], batch_size: int = 64) -> float:
    """Mean NLL per completion token (+ eos) of `pairs` under `model` (the warm-start objective)."""
    encoded = _encode(tokenizer, pairs, model.config.max_position_embeddings)
    total, count = 0.0, 0
    for start in range(0, len(encoded), batch_size):
        idx = list(range(start, min(start + batch_size, len(encoded))))
        ids, mask, labels = _batch(encoded, idx, tokenizer.pad_token_id)
        n = int((labels[:, 1:] != -100).sum())
        total += float(_loss(model, ids, mask, labels)) * n
        count += n
    return total / count


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN reports native bf16 matmul support on this CPU (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first tenth of the steps (at least one), then cosine to lr / 10."""
    return warmup_then_decay(step, steps, lr=lr, warmup=max(1, steps // 10), schedule="cosine",
                             floor=0.1)


def sft_warmstart(
    model_dir: str | Path,
    pairs: list[tuple[str, str]],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    out_dir: str | Path,
    num_threads: int | None = 2,
    bf16_autocast: bool | None = None,
) -> Path:
    """Fine-tune the checkpoint at `model_dir` on `pairs` for `steps` AdamW steps; save model and
    tokenizer (HF format) plus `warmstart.json` (per-step losses) to `out_dir`. Returns `out_dir`.
    `bf16_autocast`: None or True = bf16 matmuls, native or emulated (module docstring); False = fp32."""
    if steps < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(f"need steps >= 1, batch_size >= 1, lr > 0; got {steps}, {batch_size}, {lr}")
    if not pairs:
        raise ValueError("pairs is empty")
    prev_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        model, tok = load_checkpoint(model_dir, dtype=torch.float32)
        encoded = _encode(tok, pairs, model.config.max_position_embeddings)
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        bf16_matmul = (None if bf16_autocast is False
                       else "native" if cpu_has_native_bf16() else "emulated")
        if bf16_matmul == "native":
            autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        else:
            autocast = EmulatedBf16Autocast() if bf16_matmul else contextlib.nullcontext()
        model.train()
        order: list[int] = []
        losses: list[float] = []
        for step in range(steps):
            if len(order) < batch_size:  # next epoch: a fresh seeded permutation
                order += torch.randperm(len(encoded), generator=gen).tolist()
            idx, order = order[:batch_size], order[batch_size:]
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, steps, lr)
            with autocast:
                loss = _loss(model, *_batch(encoded, idx, tok.pad_token_id))
            if not torch.isfinite(loss.detach()):
                raise FloatingPointError(f"warm start: loss is {float(loss)} at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
        model.eval()
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tok.save_pretrained(out)
        (out / "warmstart.json").write_text(json.dumps(
            {"steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed, "pairs": len(pairs),
             "bf16_autocast": bf16_matmul is not None, "bf16_matmul": bf16_matmul,
             "loss_first": losses[0], "loss_last": losses[-1], "losses": losses}, indent=1))
        return out
    finally:
        torch.set_num_threads(prev_threads)
