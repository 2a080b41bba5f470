"""Which rollouts does a correction drop? Kept share and advantage balance of right and wrong answers.

    python -m qurl.research.studies.mask_bias CHECKPOINT [--preset smollm2-arith-sft] [--seed 0]
        [--prompts 64] [--precision int8] [--threads 1]

GRPO's advantages sum to zero within each prompt's group: the update raises the group's right
answers exactly as hard as it lowers the wrong ones (for a token-mean loss, up to their lengths). A
correction that zeroes the weight of some tokens keeps that balance only if what it drops is
independent of the reward. When it is not, the update it leaves is tilted: mostly "lower what was
sampled" if right answers are dropped more often, mostly "raise it" if wrong ones are.

A sequence-level mask is where this can bite. The geometric mask drops sequence i when
g_i = exp(mean_t log ρ_t) leaves [low, high]. Under the engine's own sampling E[log ρ_t] is
−KL(π_behav‖π_prox) per token, so the means sit below 0 and a bound of ±0.01 drops most sequences;
which survive depends on how confident each answer's tokens are (a token both policies give
probability ≈ 1 has log ρ ≈ 0) and how many there are (a mean over few tokens is noisier). Both
differ between right and wrong answers.

This measures it on one batch: from a checkpoint it samples `--prompts` training prompts × G answers
with the 8-bit engine (the run's behaviour policy, config's rollout settings), scores them, computes
GRPO advantages as the loop does, and recomputes every token's log-prob with an fp32 engine of the
same weights (the learner's π_prox at step 0; the learner is Megatron in fp32, the same function).
Then for no correction and each of qurl.algo.corrections.CUT_PRESETS at the config's bounds it
reports, with w_t the correction's weight and A_i the advantage:
- `kept_right` / `kept_wrong`: share of the tokens of right (reward 1) / wrong answers with w_t ≠ 0;
- `push`: Σ_i Σ_t w_t·A_i / Σ_i Σ_t |A_i| over groups with signal: 0 when the raise and the lower
  balance, −1 when only lowering is left, +1 when only raising is;
- `kept_adv`: Σ_t w_t·|A_i| / Σ_t |A_i|, the share of the advantage mass the update still sees.
Plus, per answer kind, the mean of mean_t log ρ_t and the mean length.
Measured on SmolLM2-135M: docs/study/smollm2_regime.md ("What the geometric mask keeps").
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from qurl.algo.corrections import CUT_PRESETS, Correction, is_weights


def mask_profile(log_is: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, right: torch.Tensor,
                 corr: Correction, presets: tuple[str, ...] = ("none", *CUT_PRESETS)
                 ) -> dict[str, dict[str, float]]:
    """{preset: {kept_right, kept_wrong, push, kept_adv}} (module docstring). log_is: [B, T] log ρ,
    0 off the mask; mask: [B, T] bool, response tokens; adv: [B] GRPO advantage; right: [B] bool.
    "none" is the uncorrected surrogate (w = 1). A kind with no token gives NaN."""
    if log_is.shape != mask.shape or adv.shape != right.shape or adv.shape[0] != mask.shape[0]:
        raise ValueError(f"shapes: log_is {tuple(log_is.shape)}, mask {tuple(mask.shape)}, "
                         f"adv {tuple(adv.shape)}, right {tuple(right.shape)}")
    m = mask.double()
    a = adv.double().unsqueeze(1) * m  # [B, T]: A_i on each response token
    out: dict[str, dict[str, float]] = {}
    for p in presets:
        w = torch.ones_like(m) if p == "none" else is_weights(log_is, mask, p, corr).w.double()
        kept = (w != 0).double() * m

        def share(rows: torch.Tensor) -> float:
            return float(kept[rows].sum() / m[rows].sum())

        out[p] = {"kept_right": share(right), "kept_wrong": share(~right),
                  "push": float((w * a).sum() / a.abs().sum()),
                  "kept_adv": float((w * a.abs()).sum() / a.abs().sum())}
    return out


def by_kind(log_is: torch.Tensor, mask: torch.Tensor, right: torch.Tensor) -> dict[str, dict[str, float]]:
    """{"right"/"wrong": {answers, mean_log_rho (mean over answers of mean_t log ρ_t), length}}."""
    n = mask.sum(1).double()  # [B]
    mean_log = log_is.double().sum(1) / n.clamp(min=1)
    return {k: {"answers": int(rows.sum()), "mean_log_rho": float(mean_log[rows].mean()),
                "length": float(n[rows].mean())}
            for k, rows in (("right", right), ("wrong", ~right))}


def sample_batch(cfg, checkpoint: str | Path, n_prompts: int, precision: str):
    """Sample and score n_prompts × G answers with the `precision` engine of `checkpoint`, and
    recompute their log-probs with an fp32 engine. Returns (tokens [B, L] prompt ++ response,
    right-padded; log_is [B, L]; response mask [B, L]; adv [B]; right [B] bool): log ρ = fp32 −
    engine log-prob of token j at column j, 0 off the mask."""
    from qurl.data.splits import load_datasets
    from qurl.engines.local import LocalEngine
    from qurl.train.batch import build_batch
    from qurl.train.generate import rollout
    from qurl.train.requests import PromptCodec
    from qurl.types import SamplingParams

    behav = LocalEngine(checkpoint, precision=precision, seed=cfg.run.seed)
    codec = PromptCodec(behav.tokenizer, cfg.data.template)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            stop_token_ids=(behav.tokenizer.eos_token_id,))
    train_set, _ = load_datasets(cfg.data, cfg.run.seed)
    groups, _ = rollout(behav, train_set[:n_prompts], codec, params,
                        group_size=cfg.rollout.group_size, run_seed=cfg.run.seed, step=0,
                        reward_timeout_s=5.0)
    behav.close()
    batch, _ = build_batch(groups, version=0, pad_id=behav.tokenizer.pad_token_id,
                           advantage=cfg.algo.advantage)
    prox = LocalEngine(checkpoint, precision="bf16")  # unquantized, computes in fp32
    temp = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0  # as the engine scores
    rows = []
    with torch.no_grad():
        for i in range(0, batch.tokens.shape[0], 16):
            logits = prox.model(input_ids=batch.tokens[i:i + 16], use_cache=False).logits.float()
            logp = torch.log_softmax(logits[:, :-1] / temp, -1)
            got = logp.gather(2, batch.tokens[i:i + 16, 1:].unsqueeze(2)).squeeze(2)
            rows.append(torch.cat([torch.zeros_like(got[:, :1]), got], 1))  # column j: token j
    mask = batch.loss_mask.bool()
    log_is = torch.where(mask, torch.cat(rows) - batch.behav_logp, torch.zeros(()))
    return batch.tokens, log_is, mask, batch.adv, batch.rewards > 0.5


def main(argv: list[str] | None = None) -> int:
    from qurl.config import load_config

    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.mask_bias",
                                description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a HF checkpoint directory (Llama/Qwen2 layout)")
    p.add_argument("--preset", default="smollm2-arith-sft")
    p.add_argument("--set", dest="sets", action="append", default=[], help="config override key=value")
    p.add_argument("--seed", type=int, default=0, help="run.seed: the training prompts and sampling")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--precision", default="int8", choices=["int8", "fp8"])
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if a.prompts < 1:
        p.error("--prompts must be >= 1")
    torch.set_num_threads(a.threads)
    cfg = load_config(a.preset, sets=[*a.sets, f"run.seed={a.seed}"])
    _, log_is, mask, adv, right = sample_batch(cfg, a.checkpoint, a.prompts, a.precision)
    for kind, row in by_kind(log_is, mask, right).items():
        print(json.dumps({"answers": kind, **{k: v for k, v in row.items() if k != "answers"},
                          "count": row["answers"]}))
    signal = adv != 0  # groups of uniform reward carry no gradient under any correction
    prof = mask_profile(log_is[signal], mask[signal], adv[signal], right[signal],
                        Correction.of(cfg.algo))
    for preset, row in prof.items():
        print(json.dumps({"correction": preset, "precision": a.precision,
                          "answers_with_signal": int(signal.sum()), **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
