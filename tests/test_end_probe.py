"""qurl/research/studies/end_probe.py: where an answer's box closes, and the end token's probability."""
from __future__ import annotations

import math

import torch

from qurl.research.studies.end_probe import box_end, end_prob, masked_run_on


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


def test_masked_run_on_weighs_the_masked_tokens_by_the_engines_probability():
    # end token 0; run-on tokens 1, 2, 3
    p_q = torch.tensor([0.5, 0.3, 0.1, 0.1], dtype=torch.float64)  # the 8-bit engine
    p_f = torch.tensor([0.6, 0.12, 0.2, 0.08], dtype=torch.float64)  # rho: 0.4 (masked), 2.0, 0.8
    got = masked_run_on(p_f.log(), p_q.log(), [0], 0.5, 5.0)
    assert math.isclose(got, 0.3 / 0.5, rel_tol=1e-6)  # token 1 is 0.3 of the 0.5 run-on mass
    assert math.isclose(masked_run_on(p_f.log(), p_q.log(), [0], 0.3, 1.5), 0.1 / 0.5, rel_tol=1e-6)
    assert masked_run_on(p_f.log(), p_q.log(), [0], 0.1, 10.0) == 0.0
    # the end tokens are not run-on tokens, however far apart the engines are on them
    q = torch.tensor([0.05, 0.475, 0.475], dtype=torch.float64)
    f = torch.tensor([0.3, 0.35, 0.35], dtype=torch.float64)  # rho: end 6.0, run-on 0.74
    assert masked_run_on(f.log(), q.log(), [0], 0.5, 5.0) == 0.0
