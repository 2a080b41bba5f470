"""The study's final evaluation: each finished arm's last checkpoint scored once more, with less noise.

Why. An arm's final accuracy in the training records is one greedy evaluation of data.eval_size
held-out questions. Its measurement noise is the binomial standard error sqrt(p(1−p)/n): 3.5
points at p = 0.5 over 200 questions, as large as the differences the ablation asks about (ACR +
UAQ within 2 points of bf16). The real-model recipe's task (one-digit, three-operand sums) has only
~230 held-out questions, so more questions cannot fix it; more answers per question can: Avg@k
(k samples per question at eval.temperature; the mean share right) averages k draws per question.
Its standard error is at most the greedy one and falls toward sqrt(p(1−p)/(n·k)) when the model's
per-question success rates are in the middle (qurl/train/eval_metrics.py).

What. `qurl study ablation --final-eval K` runs, for every finished arm without one, `qurl eval` on
its run directory's last checkpoint (the step the run ended at) with greedy decoding and Avg@K, the
rollout engine only (eval.fp_policy off), on the same held-out questions as the training evaluations
(the run's data config), keeping the right answers per question (`--per-question`: the table
measures the evaluation's standard error from them), and commits the record beside the arm's
metrics:

    <out>/<arm>/seed<S>/final_eval.json   {"k": K, "step": N, "record": {eval/..., n, ...}}

The tables use it as the final accuracy when every arm in them has one at the same K (mixing
measurements would bias the paired differences), else the training evaluations for all.
A committed arm whose run directory is gone (another machine, a cleaned disk) cannot be evaluated:
it is listed, and the table keeps the training evaluations until it is.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from qurl.research.studies.runner import arm_env
from qurl.research.studies.store import FINAL, read_final  # noqa: F401  (read_final: this module's reader)

def eval_sets(k: int) -> list[str]:
    """The `qurl eval --set` overrides of a final evaluation with Avg@k."""
    if k < 1:
        raise ValueError(f"final evaluation: k = {k}, need >= 1 samples per question")
    return ["eval.greedy=true", f"eval.samples={k}", "eval.fp_policy=false"]


def last_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run's newest checkpoint directory (ckpt/step_N), None if there is none."""
    steps = [int(p.name.removeprefix("step_")) for p in (Path(run_dir) / "ckpt").glob("step_*")
             if p.name.removeprefix("step_").isdigit()]
    return max(steps) if steps else None


def evaluate(run_dir: Path, arm_dir: Path, k: int, steps: int) -> str:
    """Score run_dir's checkpoint at `steps` (the run's end) and commit the record into arm_dir.
    Returns what happened: 'evaluated', or why not ('no run directory', 'no checkpoint at ...')."""
    if not Path(run_dir).is_dir():
        return "no run directory"
    step = last_checkpoint_step(run_dir)
    if step != steps:
        return f"no checkpoint at step {steps} (newest: {step})"
    tmp = Path(arm_dir) / f".{FINAL}.record"
    log = Path(run_dir).parent / f"{Path(run_dir).name}.final_eval.log"
    with log.open("ab") as f:
        rc = subprocess.call([sys.executable, "-m", "qurl.cli", "eval", str(run_dir), "--out",
                              str(tmp), "--per-question",
                              *(a for s in eval_sets(k) for a in ("--set", s))],
                             stdout=f, stderr=subprocess.STDOUT,
                             env=arm_env())
    if rc != 0 or not tmp.exists():
        raise RuntimeError(f"final evaluation of {run_dir} failed (exit {rc}); see {log}")
    record = json.loads(tmp.read_text())
    if record.get("step") != steps:
        raise RuntimeError(f"final evaluation of {run_dir}: scored step {record.get('step')}, "
                           f"expected {steps}")
    out = Path(arm_dir) / f".{FINAL}.tmp"
    out.write_text(json.dumps({"k": k, "step": steps, "record": record}, indent=1) + "\n")
    out.replace(Path(arm_dir) / FINAL)
    tmp.unlink()
    return "evaluated"
