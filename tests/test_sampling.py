"""The local engine's sampler: nucleus set, inverse-CDF draws, reported log-probs, greedy."""
from __future__ import annotations

import math

import pytest
import torch

from qurl.engines.sampling import check_params, nucleus, request_generator, sample

P = [0.5, 0.3, 0.15, 0.05]


def test_nucleus_keeps_smallest_set_reaching_top_p():
    probs = torch.tensor([P, P])
    out = nucleus(probs, torch.tensor([0.7, 0.85]))
    # row 0: mass before tokens = 0, .5, .8, .95 -> keep mass_before < .7 -> {0, 1}
    assert torch.equal(out[0], torch.tensor([0.5, 0.3, 0.0, 0.0]))
    assert torch.allclose(out[1], torch.tensor([0.5, 0.3, 0.15, 0.0]))


def test_sample_frequencies_and_logprobs():
    n = 4000
    logits = torch.log(torch.tensor(P)).repeat(n, 1) * 2.0  # T = 2 undoes the factor 2
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    tok, lp, _ = sample(logits, torch.full((n,), 2.0), torch.full((n,), 0.7), gens)
    freq = torch.bincount(tok, minlength=4).double() / n
    want = torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64)  # nucleus, renormalised
    sigma = math.sqrt(0.625 * 0.375 / n)
    assert (freq - want).abs().max() < 4 * sigma
    # reported log-prob: the unrestricted tempered distribution, log P[token]
    assert torch.allclose(lp, torch.log(torch.tensor(P))[tok], atol=1e-6)


def test_greedy_and_per_request_streams():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    tok, lp, _ = sample(logits, torch.zeros(1), torch.ones(1), [torch.Generator()])
    assert tok.item() == 1  # first of the tied maxima
    assert lp.item() == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))
    # A row's draw depends only on its own generator, not on the rows next to it.
    many = torch.log(torch.tensor(P)).repeat(3, 1)
    a, _, _ = sample(many, torch.ones(3), torch.ones(3), [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    b, _, _ = sample(many[1:2], torch.ones(1), torch.ones(1), [torch.Generator().manual_seed(2)])
    assert a[1] == b[0]
    fallback = torch.Generator().manual_seed(0)
    assert request_generator(None, fallback).initial_seed() != request_generator(None, fallback).initial_seed()


@pytest.mark.parametrize("args,field", [((-0.1, 1.0, 4), "temperature"), ((1.0, 0.0, 4), "top_p"),
                                        ((1.0, 1.0, 0), "max_new_tokens"), ((float("nan"), 1.0, 4), "temperature")])
def test_check_params_names_the_field(args, field):
    with pytest.raises(ValueError, match=f"request r7: {field}"):
        check_params("r7", *args)


def test_entropy_is_that_of_the_tempered_distribution_in_float64():
    """The entropy `sample` reports beside each token is H(softmax(logits / T)) over the whole
    vocabulary, before the nucleus cuts it (T = 1 for a greedy row), against a float64 reference."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 500, generator=g) * 4
    logits[3, 7:] = -1e30  # nearly all mass on seven tokens: p underflows to 0 there
    temps, top_ps = torch.tensor([1.0, 0.6, 0.0, 1.3]), torch.tensor([1.0, 0.5, 1.0, 0.9])
    _, _, ent = sample(logits, temps, top_ps, [torch.Generator().manual_seed(i) for i in range(4)])
    z = logits.double() / torch.tensor([1.0, 0.6, 1.0, 1.3], dtype=torch.float64).unsqueeze(-1)
    p = torch.softmax(z, -1)
    want = -(p * torch.log_softmax(z, -1)).nan_to_num(0.0).sum(-1)  # 0 log 0 = 0
    assert torch.isfinite(ent).all() and ent.dtype == torch.float32
    torch.testing.assert_close(ent.double(), want, rtol=1e-5, atol=1e-6)
    assert want[3] < math.log(7) + 1e-9  # the underflowed row: at most log of the 7 live tokens
