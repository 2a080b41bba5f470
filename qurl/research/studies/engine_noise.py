"""How far does a change too small to matter move the 8-bit engine? Teacher-forced KL between engines.

    python -m qurl.research.studies.engine_noise CHECKPOINT_DIR [--preset smollm2-arith-sft] [--seed 0]
        [--n 200] [--scales 1.5 1.25] [--jitter 1e-7] [--precision int8] [--threads 1]

A W8A8 engine quantizes every linear's input per token, `codes = round(127 · x / absmax(x))`. On a
model with massive activations (SmolLM2-135M's residual stream reaches ~700 in a few channels while
most sit near 1) one token's grid step is large next to most of its features, and many of them sit
near a rounding boundary. A perturbation of 1e-7 relative moves a few of them across; each flip
changes that input by a whole grid step, the next layer's inputs move by more than the first
perturbation did, flip more codes, and so on through 30 layers. The engine that comes out is then
not "the same engine within rounding" but another draw of the quantization noise.

This measures that. From one checkpoint it builds the engine at `precision` (the reference) and
engines whose weights differ by:
- `uaq s=S`: UAQ's invariant scaling (qurl.quant.uaq): the same function in exact arithmetic; the
  weight codes move only where fp32 division rounds across a boundary (~1e-6 of them at s = 1.5, none
  at s = 2),
- `linear jitter E`: every decoder linear weight times (1 + E · N(0, 1)),
- `norm jitter E`: every RMSNorm gain times (1 + E · N(0, 1)): no weight code can move, only the
  activations do,
and scores each, teacher-forced, on the eval questions' worked answers (the synthetic task's
`worked_solution`, then EOS). Per variant, over all answer tokens:
- `kl_vs_ref`: mean KL(reference ‖ variant) per token, nats;
- `kl_vs_fp32`: mean KL(fp32 ‖ variant) per token: the engine's own quantization mismatch, the
  KL(behav ‖ prox) of a run at its first step;
- `dlogp` ± `dlogp_se`: mean over questions of log p(worked answer) minus the reference's, with its
  standard error: whether the variant is systematically better or worse, or just different;
- `codes_moved` (CLI): share of the linears' 8-bit weight codes that differ from the
  reference's (fp32 row: 0 by convention, it has none).
The reference's and the fp32 engine's rows are included (their own KL 0). If `kl_vs_ref` of the
tiny perturbations is as large as `kl_vs_fp32`, every weight update redraws the engine's rounding
noise, and comparing two 8-bit arms at one evaluation compares two draws of it.
Measured on SmolLM2-135M warm starts: docs/study/smollm2_regime.md ("The 8-bit engine is chaotic").
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from qurl.engines.local import LINEAR_KINDS, LocalEngine
from qurl.quant.uaq import apply_uaq
from qurl.research.studies.uaq_codes import code_changes

State = Mapping[str, torch.Tensor]


def _jittered(state: State, eps: float, which: Callable[[str], bool], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v * (1 + eps * torch.randn(v.shape, generator=g, dtype=v.dtype)) if which(k) else v
            for k, v in state.items()}


def _decoder_linear(name: str) -> bool:
    return name.startswith("model.layers.") and any(f".{k}.weight" in name for k in LINEAR_KINDS)


def _norm_gain(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("layernorm.weight")


def perturbations(state: State, scales: Sequence[float] = (1.5,), jitter: Sequence[float] = (1e-7,),
                  seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """{variant name: perturbed copy of `state`} (see the module docstring); `state` is not modified."""
    out: dict[str, dict[str, torch.Tensor]] = {f"uaq s={s:g}": apply_uaq(state, s) for s in scales}
    for eps in jitter:
        out[f"linear jitter {eps:g}"] = _jittered(state, eps, _decoder_linear, seed)
        out[f"norm jitter {eps:g}"] = _jittered(state, eps, _norm_gain, seed)
    return out


def compare_engines(base: str | Path, variants: Mapping[str, State],
                    pairs: Sequence[tuple[list[int], list[int]]], precision: str = "int8"
                    ) -> dict[str, dict[str, float]]:
    """Score the reference engine (`base` at `precision`), an fp32 engine and one engine per variant
    on `pairs` of (prompt ids, answer ids), teacher-forced; returns {engine: {kl_vs_ref, kl_vs_fp32,
    dlogp, dlogp_se}} (module docstring). Keys: "reference", "fp32", then `variants`."""
    if not pairs:
        raise ValueError("no (prompt, answer) pairs to score")
    ref = LocalEngine(base, precision=precision)
    engines: dict[str, LocalEngine] = {"reference": ref, "fp32": LocalEngine(base, precision="bf16")}
    names = set(ref.names())
    for name, state in variants.items():
        e = LocalEngine(base, precision=precision)
        e.load_weights(((k, v) for k, v in state.items() if k in names), 1)
        engines[name] = e
    kl = {(r, n): 0.0 for r in ("reference", "fp32") for n in engines}  # summed over answer tokens
    seq_logp: dict[str, list[float]] = {n: [] for n in engines}
    for prompt, answer in pairs:
        target = torch.tensor(answer).unsqueeze(1)  # [T, 1]
        logp = {n: torch.log_softmax(e.token_logits(prompt, answer).double(), -1)  # [T, V]
                for n, e in engines.items()}
        for n, lp in logp.items():
            seq_logp[n].append(float(lp.gather(1, target).sum()))
            for r in ("reference", "fp32"):
                kl[(r, n)] += float((logp[r].exp() * (logp[r] - lp)).sum())
    tokens = sum(len(answer) for _, answer in pairs)
    out: dict[str, dict[str, float]] = {}
    ref_lp = torch.tensor(seq_logp["reference"], dtype=torch.float64)
    for n in engines:
        d = torch.tensor(seq_logp[n], dtype=torch.float64) - ref_lp
        out[n] = {"kl_vs_ref": kl[("reference", n)] / tokens, "kl_vs_fp32": kl[("fp32", n)] / tokens,
                  "dlogp": float(d.mean()),
                  "dlogp_se": float(d.std() / math.sqrt(len(d))) if len(d) > 1 else float("nan")}
    return out


def worked_answer_pairs(cfg, tokenizer, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, worked answer ids + EOS) for the first `n` questions of the synthetic eval split
    of `cfg`, the prompt rendered with cfg.data.template."""
    from qurl.data.splits import load_eval_sets
    from qurl.data.synthetic import worked_solution
    from qurl.train.requests import PromptCodec

    if cfg.data.eval != "synthetic":
        raise ValueError(f"data.eval={cfg.data.eval!r}: worked answers exist only for the synthetic task")
    codec = PromptCodec(tokenizer, cfg.data.template)
    exs = load_eval_sets(cfg.data, cfg.run.seed)["synthetic"][:n]
    return [(codec.encode(ex.prompt),
             list(tokenizer.encode(worked_solution(ex), add_special_tokens=False))
             + [tokenizer.eos_token_id]) for ex in exs]


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from qurl.config import load_config
    from qurl.models.hf import read_state_dict

    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.engine_noise",
                                description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a HF checkpoint directory (Llama/Qwen2 layout)")
    p.add_argument("--preset", default="smollm2-arith-sft", help="config whose eval questions to score")
    p.add_argument("--set", dest="sets", action="append", default=[], help="config override key=value")
    p.add_argument("--seed", type=int, default=0, help="run.seed (picks the questions) and jitter seed")
    p.add_argument("--n", type=int, default=200, help="questions")
    p.add_argument("--scales", type=float, nargs="*", default=[1.5, 1.25])
    p.add_argument("--jitter", type=float, nargs="*", default=[1e-7])
    p.add_argument("--precision", default="int8", choices=["int8", "fp8"])
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = load_config(a.preset, sets=[*a.sets, f"run.seed={a.seed}"])
    state = read_state_dict(a.checkpoint)
    tok = AutoTokenizer.from_pretrained(a.checkpoint, local_files_only=True)
    pairs = worked_answer_pairs(cfg, tok, a.n)
    variants = perturbations(state, a.scales, a.jitter, a.seed)
    result = compare_engines(a.checkpoint, variants, pairs, a.precision)
    for name, row in result.items():
        moved = code_changes(state, variants[name], a.precision)["all"] if name in variants else 0.0
        print(json.dumps({"engine": name, "precision": "fp32" if name == "fp32" else a.precision,
                          "questions": len(pairs), **row, "codes_moved": moved}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
