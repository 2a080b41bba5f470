"""Does the 8-bit engine end its answers as often as the full-precision policy does?

In the real-model ablation (docs/study/smollm2_sft) some INT8 arms learned to keep writing after
their boxed answer until the token cap ("...\\boxed{23}2+5"), while no bf16 run did. The reward
reads the last *complete* box (qurl/data/rewards.py), so a run-on cut before a second box scores
as its first answer, and nothing in the reward pushes back. This probe measures where such a drift
could start: at the token right after the answer's closing brace, the probability of the end token

    p_q = P_int8(end | prompt, answer)      p_f = P_fp32(end | prompt, answer)

on every held-out question, both teacher-forced on the same answer (the greedy answer of one of the
two engines, built from one checkpoint as `local_engine` builds them for training). At temperature 1
a rollout runs on past its answer with probability 1 − p; if p_q < p_f on most questions, the
quantized engine samples run-ons more often than the policy it stands for, and the correct ones
among them are then rewarded, with all of their tokens, by GRPO.

    python -m qurl.research.studies.end_probe RUN_DIR [--base DIR] [--precision int8]

RUN_DIR: a run whose config names the eval set and template; --base: the checkpoint (default: the
run's base_model, its warm-started start). Prints, for each engine's greedy answers, the mean and
median of p_f and p_q, the share of questions with p_q < p_f and the mean log(p_f / p_q).

It also prints how much of the first run-on token IcePop masks there (`masked_run_on`, at the
run's IcePop bounds: algo.correction.bounds for an icepop run, else [0.5, 5]). At that position
the two engines disagree in one direction, so one might expect ρ = p_f / p_q < 1 on the run-on
tokens and fear that IcePop masks exactly the tokens whose gradient would teach the policy to
stop. The share says how often that happens at the
start of a run, where the learner's policy is the fp32 one.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Sequence

import torch

from qurl.algo.corrections import Correction
from qurl.data.rewards import first_box_close


def box_end(decode: Callable[[list[int]], str], ids: Sequence[int]) -> int | None:
    """The number of tokens up to and including the one that closes the first `\\boxed{...}`
    (braces balanced), or None when no box closes within ids. decode: token ids -> text."""
    for j in range(1, len(ids) + 1):
        if first_box_close(decode(list(ids[:j]))) is not None:
            return j
    return None


def end_prob(logits: torch.Tensor, end_ids: Sequence[int]) -> float:
    """P(any end token) from one position's logits [V] (temperature 1)."""
    return torch.softmax(logits.float(), dim=-1)[list(end_ids)].sum().item()


def masked_run_on(logits_f: torch.Tensor, logits_q: torch.Tensor, end_ids: Sequence[int],
                  low: float, high: float) -> float:
    """Of the first run-on token as the quantized engine samples it (T = 1, any token but an end
    token), the share whose ratio ρ = p_f(t) / p_q(t) lies outside [low, high]: what IcePop masks
    at that position, so that no gradient teaches the policy to stop or go on there.

        Σ_{t ∉ end, ρ_t ∉ [low, high]} p_q(t)  /  Σ_{t ∉ end} p_q(t)

    logits_f, logits_q: [V], one position of the full-precision policy and of the 8-bit engine."""
    p_f = torch.softmax(logits_f.double(), dim=-1)
    p_q = torch.softmax(logits_q.double(), dim=-1)
    on = torch.ones_like(p_q, dtype=torch.bool)
    on[list(end_ids)] = False
    on &= p_q > 0  # a token the engine never samples has no ratio
    rho = p_f[on] / p_q[on]
    out = (rho < low) | (rho > high)
    return (p_q[on][out].sum() / p_q[on].sum()).item()


def probe(run_dir: Path, base: Path | None = None, precision: str = "int8") -> list[str]:
    """Lines of the report (module docstring) for run_dir's held-out set."""
    from qurl.checkpoint.rundir import read_config
    from qurl.config import validate
    from qurl.data.splits import load_eval_sets
    from qurl.engines.factory import local_engine
    from qurl.train.requests import PromptCodec
    from qurl.types import GenRequest, SamplingParams

    cfg = validate(read_config(run_dir))
    model_dir = str(base or run_dir / "base_model")
    corr = Correction.of(cfg.algo)  # the run's IcePop bounds (its own, or the usual [0.5, 5])
    icepop = (corr.icepop_low, corr.icepop_high)
    engines = {p: local_engine(model_dir, p, seed=cfg.run.seed) for p in ("bf16", precision)}
    tok = engines[precision].tokenizer
    end_ids = sorted(engines[precision].eos_token_ids)
    codec = PromptCodec(tok, cfg.data.template)
    prompts = [codec.encode(e.prompt) for exs in load_eval_sets(cfg.data, cfg.run.seed).values()
               for e in exs]
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)
    lines = [f"{model_dir}: {len(prompts)} held-out questions, end tokens {end_ids}"]
    for by in engines:
        reqs = [GenRequest(rid=str(i), prompt_ids=p, params=params) for i, p in enumerate(prompts)]
        p_of: dict[str, list[float]] = {k: [] for k in engines}
        masked: list[float] = []
        for prompt, res in zip(prompts, engines[by].generate(reqs)):
            out = res.output_ids.tolist()
            cut = box_end(tok.decode, out)
            if cut is None:
                continue
            after = {name: engine.token_logits(prompt, out[:cut] + [end_ids[0]])[-1]
                     for name, engine in engines.items()}  # logits after the answer: the last row
            for name, logits in after.items():
                p_of[name].append(end_prob(logits, end_ids))
            masked.append(masked_run_on(after["bf16"], after[precision], end_ids, *icepop))
        f, q = torch.tensor(p_of["bf16"]), torch.tensor(p_of[precision])
        if not len(f):
            lines.append(f"greedy answers of {by}: none closes a box")
            continue
        lines.append(
            f"greedy answers of {by} ({len(f)} with a box): P(end | answer) fp32 mean {f.mean():.4f}"
            f" median {f.median():.4f}; {precision} mean {q.mean():.4f} median {q.median():.4f};"
            f" {precision} lower on {(q < f).float().mean():.3f} of them;"
            f" mean log(p_fp32/p_{precision}) {(f.log() - q.log()).mean():.4f};"
            f" IcePop {list(icepop)} masks {sum(masked) / len(masked):.4f} of the first run-on"
            f" token (mean over questions; > 0.5 on {sum(m > 0.5 for m in masked)})")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--base", type=Path, default=None)
    ap.add_argument("--precision", default="int8", choices=("int8", "fp8", "w4a16"))
    args = ap.parse_args(argv)
    print("\n".join(probe(args.run_dir, args.base, args.precision)), flush=True)


if __name__ == "__main__":
    main()
