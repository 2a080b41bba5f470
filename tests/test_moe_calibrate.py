"""The calibrated split of a dense Llama into a Mixtral (qurl/models/moe_calibrate.py, method
"cluster" of qurl/models/moe_from_dense.py), on the tiny Llama of tests/tiny_hf.py (hidden 64,
intermediate 128, 2 layers) with the character tokenizer, calibrated on a few hundred tokens of
gsm8k_test:

- with every expert active and a zero router the derived model still equals the dense one
  (DENSE_TOL, fp32): the partition only reorders the neurons;
- every layer's partition is a permutation of all neurons into equal experts;
- the fitted router keeps more of the best top-k contribution than a random one, and the refitted
  down brings the kept experts' output closer to the dense MLP's (calibration tokens);
- the derivation is deterministic given the seed.
"""
from __future__ import annotations

import json

import pytest
import torch
from tiny_hf import load_eager, save_llama

from qurl.models.hf import read_state_dict
from qurl.models.moe_calibrate import balanced_partition, calibrate
from qurl.models.moe_from_dense import DERIVED, derive_moe

DENSE_TOL = 1e-4  # as tests/test_moe_mixtral.py
TOKENS = 200


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama") / "dense")


def test_every_expert_and_zero_router_equals_the_dense_llama(llama_dir, tmp_path) -> None:
    out = derive_moe(llama_dir, tmp_path / "moe", experts=4, top_k=4, router_scale=0.0,
                     calib_tokens=TOKENS)
    record = json.loads((out / DERIVED).read_text())
    assert record["method"] == "cluster" and record["calibration"]["tokens"] == TOKENS
    assert sorted(record["perms"][0]) != record["perms"][0]  # the neurons were regrouped
    dense, derived = load_eager(llama_dir), load_eager(out)
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = dense(tokens).logits, derived(tokens).logits
    assert (got - want).abs().max().item() <= DENSE_TOL


def test_partition_is_balanced_and_router_beats_random(llama_dir) -> None:
    perms, routers, downs, stats = calibrate(llama_dir, 4, 2, seed=0, tokens=TOKENS)
    assert len(perms) == len(routers) == len(downs) == 2
    for perm, router, down in zip(perms, routers, downs):
        assert torch.equal(perm.sort().values, torch.arange(128))  # every neuron exactly once
        assert all(len(set(c.tolist())) == 32 for c in perm.reshape(4, 32))
        assert router.shape == (4, 64) and torch.isfinite(router).all()
        assert down.shape == (64, 128)
    fit, rand = stats["captured_fitted"], stats["captured_random"]
    assert all(f > r + 0.02 for f, r in zip(fit, rand)), stats
    # the refitted down brings the kept experts' output closer to the dense MLP's
    assert all(a < b for a, b in zip(stats["kept_rel_err_refit"], stats["kept_rel_err"])), stats


def test_balanced_partition_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="divide"):
        balanced_partition(torch.rand(10, 12), 5)
    with pytest.raises(ValueError, match="NaN"):
        balanced_partition(torch.full((10, 12), float("nan")), 4)


def test_derivation_is_deterministic_given_the_seed(llama_dir, tmp_path) -> None:
    a = derive_moe(llama_dir, tmp_path / "a", experts=4, top_k=2, seed=3, calib_tokens=TOKENS)
    b = derive_moe(llama_dir, tmp_path / "b", experts=4, top_k=2, seed=3, calib_tokens=TOKENS)
    sa, sb = read_state_dict(a), read_state_dict(b)
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert (a / DERIVED).read_text() == (b / DERIVED).read_text().replace(str(b), str(a))
