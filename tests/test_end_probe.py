"""qurl/studies/end_probe.py: where an answer's box closes, and the end token's probability."""
from __future__ import annotations

import math

import torch

from qurl.studies.end_probe import box_end, end_prob


def _chars(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def test_box_end_counts_tokens_through_the_closing_brace():
    ids = [ord(c) for c in "9+9=18 \\boxed{23}2+5"]
    assert box_end(_chars, ids) == len("9+9=18 \\boxed{23}")
    nested = [ord(c) for c in "\\boxed{\\frac{1}{2}} and on"]
    assert box_end(_chars, nested) == len("\\boxed{\\frac{1}{2}}")  # braces balanced
    assert box_end(_chars, [ord(c) for c in "5+1=6 \\box"]) is None  # cut before the box closes
    assert box_end(_chars, [ord(c) for c in "\\boxed{12"]) is None
    assert box_end(_chars, [ord(c) for c in "no answer}"]) is None  # a brace without a box


def test_box_end_with_multi_character_tokens():
    pieces = ["7", "+", "4", "=", "11", " \\", "boxed", "{", "11", "}", "<end>"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert box_end(decode, list(range(len(pieces)))) == 10  # "}" is the 10th token


def test_end_prob_sums_the_end_tokens_softmax():
    logits = torch.tensor([0.0, math.log(3.0), 0.0, math.log(4.0)])  # softmax: 1/9, 3/9, 1/9, 4/9
    assert math.isclose(end_prob(logits, [1]), 3 / 9, rel_tol=1e-6)
    assert math.isclose(end_prob(logits, [1, 3]), 7 / 9, rel_tol=1e-6)
