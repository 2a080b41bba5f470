"""The word-wise compare of qurl/weights/delta.py gives exactly the element-wise compare's positions.

`changed_positions` on CPU XORs 8-byte words in cache-sized slices and looks at single elements
only inside the words that differ; elements before the first aligned word and after the last
are compared one by one (tensors under `SMALL` elements all of them). Closed-form check: for
every wire dtype, sizes around a word and a slice, every byte offset inside a word (arena views
start anywhere), slices of 3 words (so a tensor spans many) and densities from none to all
changed, the positions equal the plain reference (`changed_positions_bytewise`), and so do the
encoded chunks, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from qurl.weights import delta as D

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _pair(dtype: torch.dtype, size: int, offset: int, frac: float, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two views of `size` elements starting `offset` elements into their buffers; the second
    has about `frac` of its elements' bits changed (xor of a random nonzero pattern)."""
    g = torch.Generator().manual_seed(seed)
    item = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, ((size + offset + 8) * item,), generator=g, dtype=torch.uint8)
    a = raw.view(dtype)[offset:offset + size]
    b = raw.clone().view(dtype)[offset:offset + size]
    k = int(frac * size)
    if k:
        pos = torch.randint(size, (k,), generator=g)
        bits = b.view(_INT[item])
        bits[pos] ^= torch.randint(1, 127, (k,), generator=g).to(bits.dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.bfloat16,
                                   torch.float32, torch.int64])
def test_word_compare_equals_the_elementwise_reference(dtype, monkeypatch):
    monkeypatch.setattr(D, "SPAN_WORDS", 3)  # a tensor spans many slices
    monkeypatch.setattr(D, "SMALL", 0)  # and small ones are compared word-wise too
    n = 0
    for size in (0, 1, 7, 8, 9, 24, 25, 1000):
        for offset in range(8):
            for frac in (0.0, 0.02, 0.3, 1.0):
                a, b = _pair(dtype, size, offset, frac, seed=n)
                got, want = D.changed_positions(a, b), D.changed_positions_bytewise(a, b)
                assert got.dtype == torch.int64 and torch.equal(got, want), \
                    (dtype, size, offset, frac)
                n += 1


def test_signed_zero_and_nan_are_changes_word_wise():
    a = torch.zeros(37)
    b = a.clone()
    b[3], b[20], b[36] = -0.0, float("nan"), 1e-45
    assert D.changed_positions(a, b).tolist() == [3, 20, 36]


def test_encoded_chunks_are_bit_exact_against_the_reference_positions():
    """Across 64Ki blocks, at full slice size: the chunks from the word-wise positions and the
    numpy gathers equal those from the reference positions (the pre-numpy path's output)."""
    for dtype, size in ((torch.int8, 3 * D.BLOCK + 5), (torch.bfloat16, 2 * D.BLOCK + 3)):
        a, b = _pair(dtype, size, 3, 0.02, seed=7)
        ref = D.changed_positions_bytewise(a, b)
        got = D.encode_tensor("w", a, b)
        low = ref.view(torch.int16)[::4].contiguous()  # the low 16 bits, as before
        ends = torch.searchsorted(
            ref, torch.arange(1, D.n_blocks(size) + 1, dtype=torch.int64) << D.BLOCK_BITS)
        vals = b.reshape(-1).view(_INT[b.element_size()])[ref]
        assert [n for n, _ in got] == ["w" + D.POS, "w" + D.END, "w" + D.VAL]
        assert torch.equal(got[0][1], low) and got[0][1].dtype == torch.int16
        assert torch.equal(got[1][1], ends.to(torch.int32)) and got[1][1].dtype == torch.int32
        assert got[2][1].dtype == dtype
        assert torch.equal(got[2][1].view(_INT[b.element_size()]), vals)
        out = D.apply_named({"w": a}, got)["w"]
        assert torch.equal(out.view(_INT[b.element_size()]), b.view(_INT[b.element_size()]))
