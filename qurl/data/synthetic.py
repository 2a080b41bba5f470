"""Synthetic verifiable tasks: multi-digit integer arithmetic generated from a seed.

An RL-from-verifiable-rewards task needs a question, a gold answer a program can check, and a
difficulty where a small warm-started model is right sometimes but not always (so sampled groups
carry both rewards 1 and 0 and the advantages are not all zero). Integer arithmetic fits: the gold
answer is exact, and two knobs move the difficulty smoothly:
- `digits`: digits per operand (carries and borrows get more frequent and longer);
- `n_operands`: how many numbers are combined (more intermediate results to get right).

Questions are short strings such as "47+38=" or "(12+34)*5=" (evaluated left to right; a prefix is
parenthesised before `*` so the usual precedence gives the same value). `worked_solution` writes the
short answer a tiny character-level model is warm-started on (SFT) before RL:

    fold  (default)  "47+38=85 \\boxed{85}"                 one step per operator
    place            "47+30=77,77+8=85 \\boxed{85}"         the right operand split by place value
    answer           "\\boxed{85}"                           the final answer only

Invariants:
- Train and eval are disjoint by construction: a question belongs to the eval split iff a keyed hash
  of its text falls below `eval_fraction`, independent of the seed. No seed, size or call order can
  put an eval question into a train list (given the same eval_fraction).
- The same arguments always give the same list; each list holds distinct questions.
- uid is `arith:<question>`, so it is stable and unique across splits and difficulties.
- answer_kind is "number": the reward accepts only a numeral. math-verify evaluates expressions, so
  under "math" a response that copies the question into its box ("\\boxed{6+7+0}" for "6+7+0=")
  scores 1 without computing anything; SmolLM2-135M found that copy within 20–40 RL steps
  (docs/study/smollm2_regime.md, "The reward accepted the question as its answer").
"""
from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Sequence

from qurl.data.datasets import Example

__all__ = ["arithmetic_task", "worked_solution", "in_eval_split", "SOLUTION_STYLES"]

SOLUTION_STYLES = ("fold", "place", "answer")
_OPS = "+-*"


def in_eval_split(question: str, eval_fraction: float = 0.1) -> bool:
    """True iff `question` belongs to the eval split: a keyed 64-bit hash of its text < fraction."""
    digest = hashlib.blake2b(question.encode(), digest_size=8, person=b"qurl-arith-v1").digest()
    return int.from_bytes(digest, "big") < eval_fraction * 2**64


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _value(numbers: Sequence[int], ops: Sequence[str], allow_negative: bool) -> int | None:
    """The left-to-right value, or None where a negative intermediate or result is not allowed."""
    value = numbers[0]
    for op, b in zip(ops, numbers[1:]):
        value = _apply(value, op, b)
        if value < 0 and not allow_negative:
            return None
    return value


def _render(numbers: list[int], ops: list[str]) -> str:
    """Question text whose usual-precedence value equals the left-to-right value."""
    text, additive = str(numbers[0]), False
    for op, b in zip(ops, numbers[1:]):
        if op == "*" and additive:
            text, additive = f"({text})", False
        additive = additive or op in "+-"
        text = f"{text}{op}{b}"
    return text + "="


def arithmetic_task(
    n: int,
    *,
    seed: int,
    split: str,
    digits: int = 2,
    n_operands: int = 2,
    ops: str = "+-",
    eval_fraction: float = 0.1,
    allow_negative: bool = False,
    at_most: bool = False,
) -> list[Example]:
    """n distinct arithmetic questions of the given split, deterministic in all arguments.

    digits: digits per operand (1 means 0..9, d > 1 means 10^(d-1)..10^d-1).
    n_operands: numbers per question (>= 2). ops: operators to draw from, a subset of "+-*".
    allow_negative: when False, questions with a negative intermediate or final result are redrawn.
    Raises ValueError when the split cannot supply n distinct questions at this difficulty, or
    with at_most=True returns the fewer it found (a prefix of what a larger n would give).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(digits, int) or not 1 <= digits <= 9:
        raise ValueError(f"digits must be an int in [1, 9], got {digits!r}")
    if not isinstance(n_operands, int) or n_operands < 2:
        raise ValueError(f"n_operands must be an int >= 2, got {n_operands!r}")
    if not ops or any(o not in _OPS for o in ops):
        raise ValueError(f"ops must be a non-empty subset of {_OPS!r}, got {ops!r}")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    op_choices = sorted(set(ops))  # order-insensitive: "+-" and "-+" give the same stream
    lo, hi = (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
    # A str seed is hashed with SHA-512 by random.Random: stable across processes and PYTHONHASHSEED.
    rng = random.Random(f"arith:{seed}:{split}:{digits}:{n_operands}:{''.join(op_choices)}:{allow_negative}")
    want_eval = split == "eval"
    seen: set[str] = set()
    out: list[Example] = []
    budget = 200 * n + 20_000  # draws before we conclude the split is too small for n
    # Past 10n + 1000 draws a small question space is counted, so a draw that has found every
    # question of the split stops there instead of spending the rest of its budget on repeats
    # (the same list: no later draw could add one).
    count_after, available = budget - 10 * n - 1000, None
    while len(out) < n:
        budget -= 1
        if budget == count_after:
            available = _split_size(lo, hi, n_operands, op_choices, allow_negative,
                                    eval_fraction, want_eval)
        if budget < 0 or len(out) == available:
            if at_most:
                break
            raise ValueError(
                f"could only draw {len(out)} distinct {split} questions of {n} requested with "
                f"digits={digits}, n_operands={n_operands}, ops={ops!r}; lower n or raise the difficulty"
            )
        numbers = [rng.randint(lo, hi) for _ in range(n_operands)]
        chosen = [rng.choice(op_choices) for _ in range(n_operands - 1)]
        value = _value(numbers, chosen, allow_negative)
        if value is None:
            continue
        question = _render(numbers, chosen)
        if question in seen or in_eval_split(question, eval_fraction) != want_eval:
            continue
        seen.add(question)
        out.append(Example(uid=f"arith:{question}", prompt=question, answer=str(value),
                           answer_kind="number"))
    return out


_COUNT_UP_TO = 50_000  # question spaces at most this large are counted (arithmetic_task)


def _split_size(lo: int, hi: int, n_operands: int, op_choices: list[str], allow_negative: bool,
                eval_fraction: float, want_eval: bool) -> int | None:
    """How many distinct questions the split holds, or None where the space is too large to count
    cheaply (more than _COUNT_UP_TO operand and operator choices)."""
    if (hi - lo + 1) ** n_operands * len(op_choices) ** (n_operands - 1) > _COUNT_UP_TO:
        return None
    found = {_render(list(numbers), list(chosen))
             for numbers in itertools.product(range(lo, hi + 1), repeat=n_operands)
             for chosen in itertools.product(op_choices, repeat=n_operands - 1)
             if _value(numbers, chosen, allow_negative) is not None}
    return sum(in_eval_split(q, eval_fraction) == want_eval for q in found)


_TOKEN = re.compile(r"\d+|[-+*]")


def _parse(question: str) -> tuple[list[int], list[str]]:
    """Numbers and operators of a question made by `_render` (parentheses only fix precedence)."""
    if not question.endswith("=") or re.fullmatch(r"[\d+\-*()]+=", question) is None:
        raise ValueError(f"not an arithmetic question: {question!r}")
    tokens = _TOKEN.findall(question)
    num_tokens, ops = tokens[0::2], tokens[1::2]
    if len(num_tokens) != len(ops) + 1 or not all(t.isdigit() for t in num_tokens) or any(o not in _OPS for o in ops):
        raise ValueError(f"not an arithmetic question: {question!r}")
    return [int(t) for t in num_tokens], ops


def _place_parts(b: int) -> list[int]:
    """Non-zero place-value parts of b, highest first: 308 -> [300, 8]; 0 -> [0]."""
    parts = [int(d) * 10**p for p, d in enumerate(reversed(str(b))) if d != "0"]
    return list(reversed(parts)) or [0]


def _place_steps(a: int, op: str, b: int) -> tuple[list[str], int]:
    parts = _place_parts(b)
    if len(parts) == 1:
        r = _apply(a, op, b)
        return [f"{a}{op}{b}={r}"], r
    steps: list[str] = []
    if op == "*":
        products = [a * p for p in parts]
        steps += [f"{a}*{p}={q}" for p, q in zip(parts, products)]
        acc = products[0]
        for q in products[1:]:
            steps.append(f"{acc}+{q}={acc + q}")
            acc += q
        return steps, acc
    acc = a
    for p in parts:
        r = _apply(acc, op, p)
        steps.append(f"{acc}{op}{p}={r}")
        acc = r
    return steps, acc


def worked_solution(example: Example, style: str = "fold") -> str:
    """A short worked answer for an `arithmetic_task` example, ending in `\\boxed{answer}`."""
    if style not in SOLUTION_STYLES:
        raise ValueError(f"unknown solution style {style!r}; expected one of {', '.join(SOLUTION_STYLES)}")
    numbers, ops = _parse(example.prompt)
    steps: list[str] = []
    acc = numbers[0]
    for op, b in zip(ops, numbers[1:]):
        if style == "place":
            more, acc = _place_steps(acc, op, b)
            steps += more
        else:
            r = _apply(acc, op, b)
            steps.append(f"{acc}{op}{b}={r}")
            acc = r
    if str(acc) != example.answer:
        raise ValueError(f"example {example.uid!r}: question evaluates to {acc}, answer says {example.answer!r}")
    boxed = f"\\boxed{{{acc}}}"
    return boxed if style == "answer" else f"{','.join(steps)} {boxed}"
