"""Verifiable reward: is the final answer of a response mathematically equal to the gold answer?

Pipeline per response: `extract_answer` (answers.py) takes the content of the last `\\boxed{...}` (balanced
braces; `\\fbox` too), else the number after a GSM8K `####`; no answer means reward 0. Then the
extracted string is compared with the gold:
- fast path, no verifier: identical strings are equal; two plain integers (thousands commas allowed)
  compare exactly; two plain decimals that are equal as decimals are equal. Arithmetic tasks and most
  GSM8K answers never leave this path.
- otherwise `math-verify` decides (`math_equal`): both sides are wrapped in `\\boxed{}` and parsed
  into sympy (fractions, radicals, intervals, sets, equations, units...), then `verify(gold, pred)`.
  The comparison is not symmetric ("x=5" as gold accepts "5"); gold always goes first.
- answer kind "number" (`Example.answer_kind`): the extracted answer must itself be a plain numeral
  (integer or decimal, thousands commas allowed), compared exactly; anything else scores 0 and never
  reaches math-verify. math-verify evaluates expressions ("6+7+0" equals "13"), which is right for
  MATH-style answers and a hole in a task whose question is the expression: copying the question
  into the box would score 1 (synthetic.py).

Why a process pool: sympy can run for minutes (or forever) on a pathological answer such as
`9^{9^{9^{9}}}`, and math-verify's own timeout uses SIGALRM, which exists only in the main thread and
cannot interrupt long C-level work. `RewardFn` therefore runs slow-path comparisons in a few
persistent worker subprocesses (see `_reward_pool`: no fork, so safe next to torch threads and
ZeroMQ sockets; no re-import of the caller's `__main__`), each call with its own deadline. A worker
that misses its deadline is killed and replaced; its call scores 0 with `timed_out=True`. The caller
can be any thread.

Invariants:
- reward is 1.0 or 0.0; a timeout, a crashed worker or an unparsable answer is 0.0 and is reported
  (`timed_out`, `error`), never raised into the training loop.
- score_batch returns results in input order; one hanging item never delays the others past its
  own deadline, and the pool is whole again afterwards.
"""
from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal

from qurl.data import _reward_pool as pool_mod
from qurl.data.answers import extract_answer, first_box_close
from qurl.data.datasets import ANSWER_KINDS

__all__ = [
    "RewardResult",
    "RewardFn",
    "extract_answer",
    "first_box_close",
    "math_equal",
    "score",
    "score_batch",
    "shutdown_default",
]


@dataclass(frozen=True)
class RewardResult:
    reward: float  # 1.0 correct, 0.0 otherwise (including timeouts)
    timed_out: bool  # the comparison was cut by the per-call deadline
    extracted: str | None  # the answer found in the response, None if none
    error: str | None = None  # a verifier crash, reported rather than raised


_INT = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")
_DEC = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)?\.\d+")


def _fast_equal(pred: str, gold: str) -> bool | None:
    """Decide without math-verify when that is exact; None means 'ask the verifier'."""
    p, g = pred.strip(), gold.strip()
    if p == g and p:
        return True
    # Decimal, not int: exact, and no limit on digits (int() refuses > 4300 digits).
    if _INT.fullmatch(p) and _INT.fullmatch(g):
        return Decimal(p.replace(",", "")) == Decimal(g.replace(",", ""))
    if (_INT.fullmatch(p) or _DEC.fullmatch(p)) and (_INT.fullmatch(g) or _DEC.fullmatch(g)):
        if Decimal(p.replace(",", "")) == Decimal(g.replace(",", "")):
            return True
        return None  # unequal decimals: math-verify's rounding rules decide (1/3 vs 0.333333)
    return None


def _number_equal(pred: str, gold: str) -> bool:
    """Answer kind "number": `pred` is a plain numeral equal to the numeral `gold` (exactly)."""
    p, g = pred.strip(), gold.strip()
    if not _is_numeral(p):
        return False
    return Decimal(p.replace(",", "")) == Decimal(g.replace(",", ""))


def _is_numeral(s: str) -> bool:
    return bool(_INT.fullmatch(s) or _DEC.fullmatch(s))


def _as_latex(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s.strip("$").strip()
    return s if "\\boxed" in s else f"\\boxed{{{s}}}"


def math_equal(pred: str, gold: str, *, timeout_s: float | None = None, fast_path: bool = True) -> bool:
    """True iff the answer `pred` equals `gold` (fast path, else math-verify).

    timeout_s: math-verify's own SIGALRM timeout (whole seconds, main thread only). None disables it;
    use that where something else enforces a deadline (RewardFn's worker processes do).
    fast_path=False always asks math-verify (tests use it to check the verifier itself).
    """
    fast = _fast_equal(pred, gold) if fast_path else None
    if fast is not None:
        return fast
    from math_verify import parse, verify  # lazy: importing qurl must not pull sympy

    t = None if timeout_s is None else max(1, math.ceil(timeout_s))
    gold_parsed = parse(_as_latex(gold), parsing_timeout=t)
    pred_parsed = parse(_as_latex(pred), parsing_timeout=t)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=t))


class _DropNoTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeout is off; in a worker that is by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_quiet = False


def _quiet_math_verify() -> None:
    global _quiet
    if not _quiet:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropNoTimeoutWarning())
        _quiet = True


def _worker_compare(pred: str, gold: str) -> bool:
    """The default slow-path comparison run inside a worker (the pool enforces the deadline)."""
    _quiet_math_verify()
    return math_equal(pred, gold, timeout_s=None)


def _worker_verify_only(pred: str, gold: str) -> bool:
    """As _worker_compare but always through math-verify (RewardFn(fast_path=False))."""
    _quiet_math_verify()
    return math_equal(pred, gold, timeout_s=None, fast_path=False)


def _worker_warmup() -> None:
    _worker_verify_only("\\frac{1}{2}", "0.5")


class RewardFn:
    """Scores responses against gold answers with a hard per-call deadline.

    workers: slow-path worker processes, started on first need (a run whose answers all take the
    fast path never starts one). compare: the slow-path comparison `(pred, gold) -> bool`, a
    picklable module-level function; default math-verify. fast_path: decide identical strings and
    plain numbers without the verifier (False sends every extracted answer to `compare`).
    Thread-safe: concurrent callers share the pool, one batch at a time.
    """

    def __init__(
        self,
        *,
        workers: int = 2,
        timeout_s: float = 5.0,
        compare: Callable[[str, str], bool] | None = None,
        fast_path: bool = True,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"RewardFn workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardFn timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.fast_path = fast_path
        default = compare is None
        self._pool = pool_mod.WorkerPool(
            workers,
            (_worker_compare if fast_path else _worker_verify_only) if default else compare,
            # Import sympy and build math-verify's parsers before a worker says it is ready, so the
            # first real comparison is not charged ~1 s of one-off setup against its deadline.
            warmup=_worker_warmup if default else None,
            startup_timeout_s=startup_timeout_s,
        )
        self._lock = threading.Lock()
        self._counts = {"calls": 0, "no_answer": 0, "fast": 0, "slow": 0, "timeouts": 0, "errors": 0}

    @property
    def stats(self) -> dict[str, int]:
        """Counters since construction: calls, no_answer, fast, slow, timeouts, errors, respawns."""
        return {**self._counts, "respawns": self._pool.respawns}

    def score(self, response_text: str, gold: str, *, timeout_s: float | None = None,
              kind: str = "math") -> RewardResult:
        return self.score_batch([response_text], [gold], timeout_s=timeout_s, kinds=[kind])[0]

    def score_batch(
        self, texts: Sequence[str], golds: Sequence[str], *, timeout_s: float | None = None,
        kinds: Sequence[str] | None = None,
    ) -> list[RewardResult]:
        """One RewardResult per (text, gold), in order. timeout_s overrides the per-call deadline.
        kinds: each gold's answer kind (`Example.answer_kind`, module docstring); default "math"."""
        kinds = ["math"] * len(texts) if kinds is None else list(kinds)
        if not len(texts) == len(golds) == len(kinds):
            raise ValueError(f"score_batch got {len(texts)} texts but {len(golds)} golds and "
                             f"{len(kinds)} kinds")
        deadline = self.timeout_s if timeout_s is None else float(timeout_s)
        if not deadline > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        results: list[RewardResult | None] = [None] * len(texts)
        slow: list[tuple[int, str, str]] = []
        counts = {"calls": len(texts), "no_answer": 0, "fast": 0, "slow": 0, "timeouts": 0, "errors": 0}
        for i, (text, gold, kind) in enumerate(zip(texts, golds, kinds)):
            if not isinstance(text, str) or not isinstance(gold, str):
                raise ValueError(f"score_batch item {i}: text and gold must be str")
            if kind not in ANSWER_KINDS:
                raise ValueError(f"score_batch item {i}: answer kind must be one of {ANSWER_KINDS}, "
                                 f"got {kind!r}")
            if kind == "number" and not _is_numeral(gold.strip()):
                raise ValueError(f"score_batch item {i}: gold {gold!r} of kind 'number' is not a numeral")
            pred = extract_answer(text)
            if pred is None:
                counts["no_answer"] += 1
                results[i] = RewardResult(0.0, False, None)
                continue
            if kind == "number":
                counts["fast"] += 1
                results[i] = RewardResult(float(_number_equal(pred, gold)), False, pred)
                continue
            fast = _fast_equal(pred, gold) if self.fast_path else None
            if fast is not None:
                counts["fast"] += 1
                results[i] = RewardResult(float(fast), False, pred)
            else:
                slow.append((i, pred, gold))
        if slow:
            counts["slow"] += len(slow)
            with self._lock:
                outcomes = self._pool.run([(p, g) for _, p, g in slow], deadline)
            for (i, pred, _), out in zip(slow, outcomes):
                counts["timeouts"] += out.timed_out
                counts["errors"] += out.error is not None
                results[i] = RewardResult(float(out.value), out.timed_out, pred, out.error)
        with self._lock:
            for k, v in counts.items():
                self._counts[k] += v
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the worker processes (idempotent); a later call starts new ones."""
        with self._lock:
            self._pool.close()

    def __enter__(self) -> RewardFn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: RewardFn | None = None
_default_lock = threading.Lock()


def _default_fn() -> RewardFn:
    global _default
    with _default_lock:
        if _default is None:
            _default = RewardFn()
        return _default


def score(response_text: str, gold: str, *, timeout_s: float = 5.0, kind: str = "math") -> RewardResult:
    """Score one response with the process-wide default RewardFn (created on first use)."""
    return _default_fn().score(response_text, gold, timeout_s=timeout_s, kind=kind)


def score_batch(texts: Sequence[str], golds: Sequence[str], *, timeout_s: float = 5.0,
                kinds: Sequence[str] | None = None) -> list[RewardResult]:
    """Score many responses with the process-wide default RewardFn (created on first use)."""
    return _default_fn().score_batch(texts, golds, timeout_s=timeout_s, kinds=kinds)


def shutdown_default() -> None:
    """Stop the default RewardFn's workers now (interpreter exit also stops them)."""
    with _default_lock:
        if _default is not None:
            _default.close()
