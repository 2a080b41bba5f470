"""Does the 8-bit engine end its answers as often as the full-precision policy does?

In the real-model ablation (docs/study/smollm2_sft) some INT8 arms learned to keep writing after
their boxed answer until the token cap ("...\\boxed{23}2+5"), while no bf16 run did. The reward
reads the last *complete* box (qurl/data/rewards.py), so a run-on cut before a second box scores
as its first answer, and nothing in the reward pushes back. This probe measures where such a drift
could start: at the token right after the answer's closing brace, the probability of the end token

    p_q = P_int8(end | prompt, answer)      p_f = P_fp32(end | prompt, answer)

on every held-out question, both teacher-forced on the same answer (the greedy answer of one of the
two engines, built from one checkpoint as `make_engine` builds them for training). At temperature 1
a rollout runs on past its answer with probability 1 − p; if p_q < p_f on most questions, the
quantized engine samples run-ons more often than the policy it stands for, and the correct ones
among them are then rewarded, with all of their tokens, by GRPO.

    python -m qurl.studies.end_probe RUN_DIR [--base DIR] [--precision int8]

RUN_DIR: a run whose config names the eval set and template; --base: the checkpoint (default: the
run's base_model, its warm-started start). Prints, for each engine's greedy answers, the mean and
median of p_f and p_q, the share of questions with p_q < p_f and the mean log(p_f / p_q).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Sequence

import torch

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


def probe(run_dir: Path, base: Path | None = None, precision: str = "int8") -> list[str]:
    """Lines of the report (module docstring) for run_dir's held-out set."""
    from qurl.config import validate
    from qurl.data.splits import load_eval_sets
    from qurl.engines.factory import make_engine
    from qurl.rollout.requests import PromptCodec
    from qurl.train.rundir import read_config
    from qurl.types import GenRequest, SamplingParams

    cfg = validate(read_config(run_dir))
    model_dir = str(base or run_dir / "base_model")
    engines = {p: make_engine(cfg, model_dir, local=True, precision=p) for p in ("bf16", precision)}
    tok = engines[precision].tokenizer
    end_ids = sorted(engines[precision].eos_token_ids)
    codec = PromptCodec(tok, cfg.data.template)
    prompts = [codec.encode(e.prompt) for exs in load_eval_sets(cfg).values() for e in exs]
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)
    lines = [f"{model_dir}: {len(prompts)} held-out questions, end tokens {end_ids}"]
    for by in engines:
        reqs = [GenRequest(rid=str(i), prompt_ids=p, params=params) for i, p in enumerate(prompts)]
        p_of: dict[str, list[float]] = {k: [] for k in engines}
        for prompt, res in zip(prompts, engines[by].generate(reqs)):
            out = res.output_ids.tolist()
            cut = box_end(tok.decode, out)
            if cut is None:
                continue
            for name, engine in engines.items():  # logits after the answer: the last row
                p_of[name].append(end_prob(engine.token_logits(prompt, out[:cut] + [end_ids[0]])[-1],
                                           end_ids))
        f, q = torch.tensor(p_of["bf16"]), torch.tensor(p_of[precision])
        if not len(f):
            lines.append(f"greedy answers of {by}: none closes a box")
            continue
        lines.append(
            f"greedy answers of {by} ({len(f)} with a box): P(end | answer) fp32 mean {f.mean():.4f}"
            f" median {f.median():.4f}; {precision} mean {q.mean():.4f} median {q.median():.4f};"
            f" {precision} lower on {(q < f).float().mean():.3f} of them;"
            f" mean log(p_fp32/p_{precision}) {(f.log() - q.log()).mean():.4f}")
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
