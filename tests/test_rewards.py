"""Rewards: answer extraction, math-verify equivalence on real data (MATH500, GSM8K), and the per-call
timeout that keeps a hanging comparison from stalling a run."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from qurl.data import rewards
from qurl.data.datasets import load_dataset
from qurl.data.rewards import RewardFn, RewardResult, extract_answer, math_equal
from qurl.data.sets import SETS_DIR

DATA = SETS_DIR  # the evaluation sets shipped with qurl


def _rows(name: str) -> list[dict]:
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"reference data {path} not present")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Injected verifiers. They run inside the worker processes, so they must be module-level (the
# worker imports this module by name to unpickle them).
def _hangs_on_request(pred: str, gold: str) -> bool:
    if pred == "hang":
        time.sleep(3600)
    return pred == gold


def _crashes_on_request(pred: str, gold: str) -> bool:
    if pred == "crash":
        os._exit(7)
    if pred == "raise":
        raise ArithmeticError("verifier bug")
    return pred == gold


# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [("so \\boxed{42}.", "42"),
     ("\\boxed{1} then \\boxed{2}", "2"),
     ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
     ("$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$", "\\left( 3, \\frac{\\pi}{2} \\right)"),
     ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the box
     ("\\fbox{7}", "7"),
     ("\\boxed 5$ done", "5"),
     ("first \\boxed{3} then cut off \\boxed{4", "3"),  # an unclosed last box falls back to the last closed one
     ("\\boxed{ }", None),
     ("Natalia sold 48/2 = 24 clips.\n#### 1,072", "1072"),
     ("\\boxed{9} and\n#### 3", "9"),  # a box wins over ####
     ("no final answer here", None),
     ("\\boxedx{3}", None)],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_degenerate_responses():
    # RL policies repeat themselves: thousands of unclosed boxes must not make extraction quadratic.
    assert extract_answer("\\boxed{" * 20000) is None
    assert extract_answer("\\boxed{" * 20000 + "\\boxed{5}") == "5"
    assert extract_answer("\\boxed{1}" + "}" * 1000) == "1"
    huge = "7" * 5000  # beyond int()'s 4300-digit limit: the fast path must still decide exactly
    assert math_equal(huge, "0" + huge) and not math_equal(huge, huge[:-1] + "8")


# ---------------------------------------------------------------- equivalence, hand-checked


@pytest.mark.parametrize(
    "pred, gold, equal",
    [("\\frac{1}{2}", "0.5", True), ("\\dfrac{2}{4}", "\\frac12", True), ("1,000", "1000", True),
     ("3.0", "3", True), ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
     ("(-\\infty, 2]", "(-\\infty,2]", True), ("2", "3", False), ("\\frac{1}{3}", "0.3", False),
     ("x^2+2x+1", "(x+1)^2", True), ("\\pi", "3", False), ("7", "025", False), ("25", "025", True)],
)
def test_math_equal_hand_checked(pred, gold, equal):
    assert math_equal(pred, gold, fast_path=False) is equal
    assert math_equal(pred, gold) is equal  # the fast path never contradicts the verifier


def test_fast_path_keeps_integers_out_of_the_pool():
    with RewardFn(workers=1) as fn:
        res = fn.score_batch(["x \\boxed{46}", "\\boxed{47}", "#### 1,000", "nothing"], ["46", "46", "1000", "1"])
        assert [r.reward for r in res] == [1.0, 0.0, 1.0, 0.0]
        assert res[3] == RewardResult(0.0, False, None)
        assert fn.stats["fast"] == 3 and fn.stats["no_answer"] == 1 and fn.stats["slow"] == 0
        assert fn._pool._workers == []  # no worker process was ever started


def test_module_level_score_batch():
    res = rewards.score_batch(["\\boxed{12}", "\\boxed{13}"], ["12", "12"], timeout_s=5.0)
    assert [r.reward for r in res] == [1.0, 0.0]
    assert rewards.score("\\boxed{\\frac{3}{6}}", "\\frac{1}{2}").reward == 1.0
    rewards.shutdown_default()


def test_number_answers_must_be_numerals_the_question_copied_is_not_an_answer():
    """The hole SmolLM2 found (session 16): math-verify evaluates "6+7+0" to 13, so under "math" a
    response that boxes the question scores 1. Answer kind "number" takes numerals only."""
    copied, computed = "To find \\boxed{6+7+0}, we add.", "6+7+0 = 13. \\boxed{13}"
    with RewardFn(workers=1) as fn:
        assert fn.score(copied, "13").reward == 1.0  # the verifier's design, kept for "math"
        got = fn.score_batch(
            [copied, computed, "\\boxed{13.0}", "\\boxed{1,013}", "\\boxed{-13}", "\\boxed{\\frac{26}{2}}",
             "\\boxed{13}", "no box"],
            ["13", "13", "13", "1013", "13", "13", "-13", "13"], kinds=["number"] * 8)
        assert [r.reward for r in got] == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        assert got[0].extracted == "6+7+0" and got[7].extracted is None
        assert fn.stats["slow"] == 1  # only the "math" call reached math-verify
        with pytest.raises(ValueError, match="not a numeral"):
            fn.score_batch(["\\boxed{1}"], ["x=1"], kinds=["number"])
        with pytest.raises(ValueError, match="answer kind"):
            fn.score_batch(["\\boxed{1}"], ["1"], kinds=["integer"])
        with pytest.raises(ValueError, match="1 kinds"):
            fn.score_batch(["\\boxed{1}", "\\boxed{2}"], ["1", "2"], kinds=["number"])


# ---------------------------------------------------------------- real data


@pytest.mark.slow
def test_math500_solutions_equal_their_answers_and_not_others():
    rows = _rows("math500.jsonl")
    solutions = [r["solution"] for r in rows]
    answers = [r["answer"] for r in rows]
    # fast_path=False: every comparison goes through math-verify (the boxed text usually equals the
    # answer string verbatim, which the fast path would accept without checking anything).
    with RewardFn(workers=2, fast_path=False, timeout_s=20.0) as fn:
        same = fn.score_batch(solutions, answers)
        # Pair each solution with the next row whose answer string differs.
        others = []
        for i in range(len(rows)):
            j = next(k % len(rows) for k in range(i + 1, i + len(rows)) if answers[k % len(rows)] != answers[i])
            others.append(answers[j])
        crossed = fn.score_batch(solutions, others)
        stats = fn.stats
    assert stats["timeouts"] == 0 and stats["errors"] == 0 and stats["slow"] == 1000
    failed = [(i, r.extracted, answers[i]) for i, r in enumerate(same) if r.reward != 1.0]
    print(f"\nmath500: {len(rows) - len(failed)}/{len(rows)} solutions judged equal to their answer")
    assert failed == []
    wrongly_equal = [(i, r.extracted, others[i]) for i, r in enumerate(crossed) if r.reward == 1.0]
    print(f"math500: {len(wrongly_equal)}/{len(rows)} mismatched pairs judged equal: {wrongly_equal}")
    # Known: row 22's solution "5" against gold "x=5" is equal by math-verify's design (gold equations
    # accept their right-hand side).
    assert len(wrongly_equal) <= len(rows) // 100


def test_gsm8k_worked_answers_equal_their_final_number():
    rows = _rows("gsm8k_test.jsonl")
    golds = [e.answer for e in load_dataset(DATA / "gsm8k_test.jsonl", "gsm8k")]
    worked = [r["answer"] for r in rows]
    with RewardFn(workers=1) as fn:
        same = fn.score_batch(worked, golds)
        assert all(r.reward == 1.0 for r in same)
        # Mismatched: each worked answer against the next different gold number.
        shifted = [next(golds[k % len(golds)] for k in range(i + 1, i + len(golds)) if golds[k % len(golds)] != golds[i])
                   for i in range(len(golds))]
        crossed = fn.score_batch(worked, shifted)
        assert sum(r.reward for r in crossed) == 0.0
        assert fn.stats["slow"] == 0  # GSM8K integers never need the verifier


# ---------------------------------------------------------------- timeouts and failures


def test_hanging_call_is_cut_and_the_next_call_works():
    with RewardFn(workers=1, timeout_s=1.0, compare=_hangs_on_request, fast_path=False) as fn:
        assert fn.score("\\boxed{ok}", "ok") == RewardResult(1.0, False, "ok")
        hung = fn.score("\\boxed{hang}", "hang")
        assert hung == RewardResult(0.0, True, "hang")
        assert fn.score("\\boxed{ok}", "ok").reward == 1.0  # served by the replacement worker
        # In a batch, one hanging item is cut and the rest are scored normally.
        batch = fn.score_batch(["\\boxed{a}", "\\boxed{hang}", "\\boxed{b}", "\\boxed{c}"], ["a", "x", "b", "d"])
        assert [(r.reward, r.timed_out) for r in batch] == [(1.0, False), (0.0, True), (1.0, False), (0.0, False)]
        assert fn.stats["timeouts"] == 2 and fn.stats["respawns"] == 2


def test_scoring_from_a_thread_with_a_hanging_call():
    out: list[RewardResult] = []
    with RewardFn(workers=2, timeout_s=1.0, compare=_hangs_on_request, fast_path=False) as fn:
        worker = threading.Thread(target=lambda: out.extend(fn.score_batch(["\\boxed{hang}", "\\boxed{y}"], ["1", "y"])))
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive()
    assert [(r.reward, r.timed_out) for r in out] == [(0.0, True), (1.0, False)]


@pytest.mark.slow
def test_pathological_expression_is_cut_by_the_timeout():
    # sympy tries to evaluate 9^(9^(9^9)) when comparing it: effectively forever.
    with RewardFn(workers=1, timeout_s=1.0) as fn:
        res = fn.score("the answer is \\boxed{9^{9^{9^{9}}}}", "1")
        assert res == RewardResult(0.0, True, "9^{9^{9^{9}}}")
        assert fn.score("\\boxed{\\frac{6}{4}}", "\\frac{3}{2}").reward == 1.0


def test_crashing_or_raising_verifier_is_reported_not_fatal():
    with RewardFn(workers=1, timeout_s=30.0, compare=_crashes_on_request, fast_path=False) as fn:
        res = fn.score_batch(["\\boxed{crash}", "\\boxed{raise}", "\\boxed{z}"], ["1", "1", "z"])
    assert res[0].reward == 0.0 and not res[0].timed_out and "exit code 7" in res[0].error
    assert res[1].reward == 0.0 and res[1].error == "ArithmeticError: verifier bug"
    assert res[2] == RewardResult(1.0, False, "z")


def test_bad_arguments():
    fn = RewardFn(workers=1)
    with pytest.raises(ValueError, match="2 texts but 1 golds"):
        fn.score_batch(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="picklable"):
        RewardFn(compare=lambda p, g: True)
    with pytest.raises(ValueError, match="workers"):
        RewardFn(workers=0)


def _gone(pid: int) -> bool:
    """True once pid has exited (a zombie awaiting its reaper counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_worker_exits_when_its_parent_is_killed_mid_call():
    import signal
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from qurl.data.rewards import RewardFn\n"
        "from test_rewards import _hangs_on_request\n"
        "fn = RewardFn(workers=1, timeout_s=3600, compare=_hangs_on_request, fast_path=False)\n"
        "assert fn.score('\\\\boxed{ok}', 'ok').reward == 1.0\n"
        "print(fn._pool._workers[0].proc.pid, flush=True)\n"
        "fn.score('\\\\boxed{hang}', 'hang')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        worker_pid = int(parent.stdout.readline())
        time.sleep(0.5)  # let the hanging call reach the worker
        assert not _gone(worker_pid)
        parent.send_signal(signal.SIGKILL)  # no cleanup runs in the parent
        parent.wait()
        for _ in range(300):  # the worker's watchdog polls every second
            if _gone(worker_pid):
                break
            time.sleep(0.1)
        assert _gone(worker_pid)
    finally:
        parent.kill()
        parent.wait()
