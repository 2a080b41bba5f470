"""Evaluation as the paper reports it: every set of data.eval, greedy, Avg@k and pass@k, for the
rollout engine (the 8-bit actor) and for the full-precision policy side by side.

An evaluation record (`kind: "eval"` in metrics.jsonl) holds, for WHO in
- `eval`     the rollout engine as it is (8-bit weights in QuRL; what the actor samples),
- `eval_fp`  the full-precision policy: the learner's master weights, unquantized, in a local engine
             (only with eval.fp_policy and an 8-bit rollout precision),
- `eval_gap` eval − eval_fp: what quantization costs the policy at this step,
the keys `WHO/<set>/greedy`, `WHO/<set>/avg@k`, `WHO/<set>/pass@j` (set = file stem, e.g.
`aime24`, or `synthetic`) and `WHO/mean/...`, their unweighted mean over the sets. Also
`accuracy` (the rollout engine's headline: mean greedy accuracy if eval.greedy, else mean Avg@k),
`n` (problems over all sets) and `time/eval`; with `per_question` (`qurl eval --per-question`),
`eval_counts`: the rollout engine's right answers per question ({"<set>/greedy" | "<set>/avg@k":
[count per question]}), from which an evaluation's standard error is measured
(qurl/research/studies/tables.py); with `answers` (`qurl eval --answers`), `eval_answers`: the rollout
engine's greedy answers as text ({"<set>/greedy": [text per question]}; the fp policy's, when it
is evaluated, as `eval_fp_answers`), to read why the misses
miss (qurl/research/studies/misses.py).

Sampled answers use seeds derived from (run seed, uid, sample index) only, so both engines, and every
evaluation of a run, see the same random numbers: differences between them and over steps are not
sampling noise of the seeds. Pushing the master weights to the full-precision engine is a collective
over the learner ranks (`learner.named_weights()`): every rank calls `Evaluator.run`.

The actor's answers come from a `Generator`: the sync loop's rollout engine, or the async
controller's workers (qurl/pipeline/remote_eval.py, which run the very requests built here on
their engines). Either way the answers are scored here, by the same code, into the same keys.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol

from qurl.config import DataConfig, DeployConfig, EvalConfig, RolloutConfig
from qurl.data.datasets import Example
from qurl.types import Engine
from qurl.train.eval_metrics import mean_over_sets, set_metrics
from qurl.train.generate import to_trajectories
from qurl.train.requests import PromptCodec, request_seed
from qurl.types import GenRequest, GenResult, SamplingParams

EVAL_STEP = -1  # the `step` of request_seed for evaluation samples: fixed, so every eval agrees


class Generator(Protocol):
    """What answers evaluation requests: any `Engine`, or the async workers. `generate` returns
    one result per request, in request order (rids kept); `tokenizer` encodes the prompts."""

    tokenizer: Any

    def generate(self, requests: list[GenRequest]) -> list[GenResult]: ...


def needs_fp_policy(ecfg: EvalConfig, rollout: RolloutConfig) -> bool:
    """Whether evaluations also score the full-precision policy (a collective on every rank)."""
    return ecfg.fp_policy and rollout.precision != "bf16"


def _correct(engine: Generator, sets: dict[str, list[Example]], codec: PromptCodec,
             params: SamplingParams, n: int, *, run_seed: int, reward_timeout_s: float,
             texts: dict[str, list[str]] | None = None) -> dict[str, list[int]]:
    """{set: right answers among n samples, per problem}; n=1 with temperature 0 is greedy. A dict
    passed as `texts` receives, per set, each problem's first answer as text."""
    examples = [ex for exs in sets.values() for ex in exs]
    reqs = []
    for ex in examples:
        ids = codec.encode(ex.prompt)
        for j in range(n):
            seeded = params if params.temperature == 0 else \
                replace(params, seed=request_seed(run_seed, EVAL_STEP, ex.uid, j))
            reqs.append(GenRequest(rid=f"{ex.uid}#{j}", prompt_ids=ids, params=seeded))
    groups = to_trajectories(engine.generate(reqs), examples, codec,
                             reward_timeout_s=reward_timeout_s)
    right = {g[0].prompt_uid: sum(t.reward > 0 for t in g) for g in groups}
    if texts is not None:
        first = {g[0].prompt_uid: codec.decode(g[0].response_ids) for g in groups}
        texts.update({name: [first[ex.uid] for ex in exs] for name, exs in sets.items()})
    return {name: [right[ex.uid] for ex in exs] for name, exs in sets.items()}


def score_engine(engine: Generator, sets: dict[str, list[Example]], codec: PromptCodec,
                 ecfg: EvalConfig, *, max_new_tokens: int, run_seed: int,
                 reward_timeout_s: float, counts: dict[str, list[int]] | None = None,
                 answers: dict[str, list[str]] | None = None) -> dict[str, float]:
    """One engine's metrics: {"<set>/greedy", "<set>/avg@k", "<set>/pass@j", "mean/..."}. A dict
    passed as `counts` receives the right answers per question, in set order, under the key of
    the accuracy they make ("<set>/greedy": 0 or 1; "<set>/avg@k": 0..k); one passed as
    `answers`, the greedy answers' text ("<set>/greedy": [text per question])."""
    counts = {} if counts is None else counts
    stop = (engine.tokenizer.eos_token_id,) if engine.tokenizer.eos_token_id is not None else ()
    per_set: dict[str, dict[str, float]] = {name: {} for name in sets}
    kw: dict[str, Any] = dict(run_seed=run_seed, reward_timeout_s=reward_timeout_s)
    if ecfg.greedy:
        greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop)
        texts: dict[str, list[str]] | None = {} if answers is not None else None
        for name, right in _correct(engine, sets, codec, greedy, 1, texts=texts, **kw).items():
            per_set[name]["greedy"] = sum(right) / len(right)
            counts[f"{name}/greedy"] = right
            if answers is not None and texts is not None:
                answers[f"{name}/greedy"] = texts[name]
    if ecfg.samples:
        sampled = SamplingParams(max_new_tokens=max_new_tokens, temperature=ecfg.temperature,
                                 top_p=ecfg.top_p, stop_token_ids=stop)
        for name, right in _correct(engine, sets, codec, sampled, ecfg.samples, **kw).items():
            per_set[name].update(set_metrics(right, ecfg.samples, ecfg.pass_k))
            counts[f"{name}/avg@{ecfg.samples}"] = right
    out = {f"{name}/{k}": v for name, m in per_set.items() for k, v in m.items()}
    out.update({f"mean/{k}": v for k, v in mean_over_sets(per_set).items()})
    return out


def summary(rec: dict[str, Any]) -> str:
    """One log line: the mean metrics of the rollout engine, with the fp policy's beside them."""
    parts = []
    for key in sorted(k for k in rec if k.startswith("eval/mean/")):
        metric = key.removeprefix("eval/mean/")
        text = f"{metric} {rec[key]:.3f}"
        if f"eval_fp/mean/{metric}" in rec:
            text += f" (fp {rec[f'eval_fp/mean/{metric}']:.3f}, gap {rec[f'eval_gap/mean/{metric}']:+.3f})"
        parts.append(text)
    sets = sorted({k.split("/")[1] for k in rec if k.startswith("eval/")} - {"mean"})
    return (f"[eval] step {rec['step']}: " + ", ".join(parts)
            + f" over {len(sets)} set(s), {int(rec['n'])} problems")


def _check_placement(ecfg: EvalConfig, rollout: RolloutConfig, deploy: DeployConfig,
                     model_dir: str, asynchronous: bool, n_problems: int) -> None:
    import json
    from pathlib import Path

    import torch

    from qurl.train.eval_placement import check_eval, eval_placement

    placement = eval_placement(ecfg, rollout, cuda=torch.cuda.is_available(),
                               asynchronous=asynchronous)
    path = Path(model_dir) / "config.json"
    fields = json.loads(path.read_text()) if path.is_file() else None
    check_eval(ecfg, deploy, placement, fields, n_problems)


class Evaluator:
    """Scores the rollout engine and, side by side, the full-precision policy on data.eval."""

    def __init__(self, ecfg: EvalConfig, data: DataConfig, rollout: RolloutConfig,
                 deploy: DeployConfig, model_dir: str, *, seed: int, main: bool,
                 max_examples: int | None = None, per_question: bool = False,
                 answers: bool = False, asynchronous: bool = False) -> None:
        """What is scored and how: `[eval]`; the sets and their prompt template: `[data]` with
        the run's seed (run.seed, which also seeds the sampled answers); rollout.precision
        (whether there is an fp policy to score beside the actor); deploy.reward_timeout_s and
        deploy.eval_gpu_gb. asynchronous: the actor is scored on the async controller's workers,
        not on rank 0; the local evaluation engine (the fp policy) on a GPU is checked against
        deploy.eval_gpu_gb first (eval_placement.py), on rank 0 (`main`)."""
        from qurl.data.splits import load_eval_sets
        from qurl.engines.factory import local_engine
        from qurl.weights.publish import WeightSync

        self.ecfg, self.template, self.seed = ecfg, data.template, seed
        self.reward_timeout_s = deploy.reward_timeout_s
        self.fp = needs_fp_policy(ecfg, rollout)
        self.per_question, self.answers = per_question, answers
        self.sets: dict[str, list[Example]] = {}
        self.fp_engine: Engine | None = None
        if main:
            self.sets = {k: v[:max_examples] if max_examples else v
                         for k, v in load_eval_sets(data, seed).items()}
            _check_placement(ecfg, rollout, deploy, model_dir, asynchronous,
                             sum(map(len, self.sets.values())))
            if self.fp:
                self.fp_engine = local_engine(model_dir, "bf16", seed=seed)
        self.fp_sync = WeightSync("bf16") if self.fp else None

    def run(self, step: int, version: int, engine: Generator | None, learner: Any) -> dict | None:
        """Evaluate at `step`. `engine`: what answers with this version's actor (the rollout
        engine, or the async workers; None on learner ranks other than 0, which only take part
        in the weight gather). Returns the record on rank 0 (module docstring), None elsewhere."""
        t0 = time.perf_counter()
        if self.fp_sync is not None:
            self.fp_sync.push(learner.named_weights(), self.fp_engine, version)
        if engine is None:
            return None
        ecfg, kw = self.ecfg, dict(max_new_tokens=self.ecfg.max_new_tokens, run_seed=self.seed,
                                   reward_timeout_s=self.reward_timeout_s)
        codec = PromptCodec(engine.tokenizer, self.template)
        rec: dict[str, Any] = {"kind": "eval", "step": step, "version": version}
        counts: dict[str, list[int]] = {}
        texts: dict[str, list[str]] | None = {} if self.answers else None
        quant = score_engine(engine, self.sets, codec, ecfg, counts=counts, answers=texts, **kw)
        rec.update({f"eval/{k}": v for k, v in quant.items()})
        if self.per_question:
            rec["eval_counts"] = counts
        if self.answers:
            rec["eval_answers"] = texts
        if self.fp_engine is not None:
            fp_texts: dict[str, list[str]] | None = {} if self.answers else None
            fp = score_engine(self.fp_engine, self.sets, codec, ecfg, answers=fp_texts, **kw)
            rec.update({f"eval_fp/{k}": v for k, v in fp.items()})
            if fp_texts is not None:
                rec["eval_fp_answers"] = fp_texts
            rec.update({f"eval_gap/{k}": quant[k] - fp[k] for k in quant})
        head = "greedy" if ecfg.greedy else f"avg@{ecfg.samples}"
        rec["accuracy"] = quant[f"mean/{head}"]
        rec["n"] = float(sum(len(v) for v in self.sets.values()))
        rec["time/eval"] = time.perf_counter() - t0
        return rec
