"""qurl/research/studies/misses.py: where an answer's first box closes, and each kind of miss on answers
written by hand (the kinds follow from the reward's rule: the last complete box is the answer)."""
from __future__ import annotations

import json

import pytest

from qurl.data.rewards import first_box_close
from qurl.research.studies.misses import KINDS, Miss, classify, report, tally


def test_first_box_close_is_the_brace_that_closes_the_first_box():
    text = "9+9=18 \\boxed{18}2+5 \\boxed{7}"
    assert first_box_close(text) == text.index("}")
    nested = "\\boxed{\\frac{1}{2}} more"
    assert first_box_close(nested) == len("\\boxed{\\frac{1}{2}}") - 1
    assert first_box_close("\\boxed {4}") == len("\\boxed {4}") - 1  # a space before the brace
    assert first_box_close("5+1=6 \\boxed{6") is None  # cut before it closes
    assert first_box_close("no box here}") is None
    assert first_box_close("\\boxed 5 then \\boxed{6}") == len("\\boxed 5 then \\boxed{6}") - 1


@pytest.mark.parametrize("text, kind, runs_on", [
    ("4+5=9 \\boxed{9}", "right", False),
    ("4+5=9 \\boxed{9}  \n", "right", False),  # white space after the box is not a run-on
    ("4+5=9 \\boxed{9}2+5", "right", True),  # cut before a second box: still its first answer
    ("4+5=9 \\boxed{9}2+5=7 \\boxed{9}", "right", True),  # the second box agrees
    ("4+5=9 \\boxed{9}2+5=7 \\boxed{7}", "second box", True),  # the run-on cost the answer
    ("4+5=8 \\boxed{8}", "first wrong", False),
    ("4+5=8 \\boxed{8}2+1", "first wrong", True),
    ("4+5=8 \\boxed{8} so \\boxed{7}", "first wrong", True),
    ("4+5=8 \\boxed{8} no, \\boxed{9}", "right", True),  # a run-on that repaired it
    ("4+5=9 \\boxed{", "no box", False),  # the cap fell inside the box
    ("4+5=9", "no box", False),
    ("\\boxed 9", "right", False),  # the reward's `\\boxed 9` form, no braces to run on from
])
def test_classify(text, kind, runs_on):
    assert classify(text, "9", "number") == Miss(kind, runs_on)


def test_tally_counts_every_kind_and_its_run_ons():
    got = tally([Miss("right", True), Miss("right", False), Miss("second box", True)])
    assert list(got) == list(KINDS)
    assert got == {"right": (2, 1), "first wrong": (0, 0), "second box": (1, 1), "no box": (0, 0)}


def test_report_refuses_a_record_without_answers(tmp_path):
    rec = tmp_path / "r.json"
    rec.write_text(json.dumps({"step": 3, "eval/mean/greedy": 0.5}))
    with pytest.raises(ValueError, match="no eval_answers"):
        report(tmp_path, [rec])
