"""Why a held-out answer misses: a wrong first answer, a run-on's second box, or no box at all.

In the real-model ablation (docs/study/smollm2_sft) some INT8 arms learned to keep writing after
their boxed answer until the token cap ("9+9=18,18+5=23 \\\\boxed{23}2+5"), and some of their
held-out accuracies fell late in the run while the training reward rose. The reward reads the last
*complete* box (qurl/data/rewards.py), so a run-on can cost an answer only by closing a second,
different box before the cap; otherwise it scores as its first answer. Whether the run-on caused a
drop is therefore a question about the answers' text, and this module answers it. Each greedy
held-out answer is one of

    right          its last complete box is the gold answer (the reward is 1)
    first wrong    its first box is wrong: the arithmetic failed, run-on or not
    second box     its first box is right, a later box is not: the run-on cost the answer
    no box         no box closes: cut at the cap (or never boxed) before answering

and it *runs on* when anything but white space follows its first box. The counts of the kinds, and
how many of each run on, say which mechanism moved the accuracy between two checkpoints.

    qurl eval RUN_DIR --step N --answers --set eval.samples=0 --out step_N.json   (one per step)
    python -m qurl.research.studies.misses RUN_DIR step_30.json step_40.json

RUN_DIR's config names the held-out sets (their gold answers and answer kinds); each record is a
`qurl eval --answers` record of that run (`eval_answers`, qurl/train/eval_suite.py).
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from qurl.data.rewards import first_box_close, score

KINDS = ("right", "first wrong", "second box", "no box")


@dataclass(frozen=True)
class Miss:
    """One answer's verdict: its kind (KINDS) and whether it runs on past its first box."""

    kind: str
    runs_on: bool


def classify(text: str, gold: str, answer_kind: str = "math") -> Miss:
    """The kind of one answer (module docstring), scored by the training reward's own rules."""
    close = first_box_close(text)
    if close is None:
        right = score(text, gold, kind=answer_kind).reward > 0  # `\\boxed 5` or `#### 5`
        return Miss("right" if right else "no box", runs_on=False)
    runs_on = bool(text[close + 1:].strip())
    if score(text, gold, kind=answer_kind).reward > 0:
        return Miss("right", runs_on)
    first_right = score(text[:close + 1], gold, kind=answer_kind).reward > 0
    return Miss("second box" if first_right else "first wrong", runs_on)


def tally(misses: list[Miss]) -> dict[str, tuple[int, int]]:
    """{kind: (answers of that kind, how many of them run on)}, every kind present."""
    n = Counter(m.kind for m in misses)
    on = Counter(m.kind for m in misses if m.runs_on)
    return {k: (n[k], on[k]) for k in KINDS}


def report(run_dir: Path, records: list[Path]) -> list[str]:
    """Lines: for each record, each set's kinds (count, of which run on) and accuracy."""
    from qurl.checkpoint.rundir import read_config
    from qurl.config import validate
    from qurl.data.splits import load_eval_sets
    from qurl.research.studies.records import open_records

    # the run's config and the records may be packed in a study's archive (qurl/research/studies/records.py)
    recs = {path: json.loads(open_records(Path(path).parent).read_text(Path(path).name))
            for path in records}
    for path, rec in recs.items():
        if not rec.get("eval_answers"):
            raise ValueError(f"{path}: no eval_answers; write it with `qurl eval --answers --out`")
    with open_records(run_dir).on_disk("config.toml") as where:
        cfg = validate(read_config(where))
        sets = load_eval_sets(cfg.data, cfg.run.seed)
    lines = []
    for path, rec in recs.items():
        for key, texts in sorted(rec["eval_answers"].items()):
            name = key.split("/")[0]
            exs = sets.get(name)
            if exs is None or len(exs) != len(texts):
                raise ValueError(f"{path}: {key} has {len(texts)} answers, {run_dir}'s config "
                                 f"holds {len(exs) if exs else 'no'} '{name}' questions")
            counts = tally([classify(t, ex.answer, ex.answer_kind) for t, ex in zip(texts, exs)])
            parts = ", ".join(f"{k} {c} ({o} run on)" for k, (c, o) in counts.items())
            lines.append(f"step {rec.get('step')} {key}: {parts}; "
                         f"accuracy {counts['right'][0] / len(texts):.3f} of {len(texts)}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("records", type=Path, nargs="+", help="`qurl eval --answers --out` records")
    args = ap.parse_args(argv)
    print("\n".join(report(args.run_dir, args.records)), flush=True)


if __name__ == "__main__":
    main()
