"""Flip fraction: the share of 8-bit codes that change between two consecutive weight syncs.

It is the direct measure of how much of a training step the quantized rollout policy actually
receives: a code that did not flip means the engine runs the same weight as before. Under Adam at
RL learning rates most codes never flip; update-aware invariant scaling (qurl.quant.uaq) raises the
fraction in the layers it scales by ≈ s.

Codes are compared bit for bit (through an integer view of the same width), so FP8 codes compare
by their bytes: +0 and −0 count as different codes, and equality never depends on float semantics.

`flip_fractions` aggregates over the quantized linears of a named state (`is_quantized_linear`
names; `_scale` entries are ignored): "all", "uaq_scaled" (q/k/v/gate/up), "unscaled" (o/down),
and per projection kind ("q_proj", …). Aggregates are weighted by element count; a group with no
tensor is omitted.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qurl.quant.named import is_quantized_linear
from qurl.quant.uaq import uaq_scaled

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _changed(before: torch.Tensor, after: torch.Tensor) -> int:
    if before.shape != after.shape:
        raise ValueError(f"shapes differ: {tuple(before.shape)} vs {tuple(after.shape)}")
    if before.dtype != after.dtype:
        raise ValueError(f"dtypes differ: {before.dtype} vs {after.dtype}")
    if before.numel() == 0:
        raise ValueError("cannot compute a flip fraction of an empty tensor")
    as_int = _INT_OF_SIZE.get(before.element_size())
    if as_int is None or before.is_complex():
        raise ValueError(f"unsupported dtype {before.dtype}")
    b = before.contiguous().view(as_int)
    a = after.contiguous().view(as_int)
    return int((a != b).sum())


def flip_fraction(before: torch.Tensor, after: torch.Tensor) -> float:
    """Share of elements whose code (bit pattern) changed. before, after: same shape and dtype."""
    return _changed(before, after) / before.numel()


def flip_fractions(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Flip fractions over the quantized-linear code tensors of two named states (see module doc)."""
    names = sorted(n for n in before if is_quantized_linear(n))
    other = sorted(n for n in after if is_quantized_linear(n))
    if names != other:
        missing = sorted(set(names) ^ set(other))
        raise ValueError(f"before/after hold different quantized linears, e.g. {missing[0]!r}")
    changed = {}
    for name in names:
        try:
            changed[name] = _changed(before[name], after[name])
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from err
    return aggregate_flips(changed, {n: before[n].numel() for n in names})


def aggregate_flips(changed: Mapping[str, int], numel: Mapping[str, int]) -> dict[str, float]:
    """The groups of `flip_fractions` from per-tensor counts of changed codes (quantized-linear
    names only; others are ignored): for a caller that already compared the codes."""
    flips: dict[str, int] = {}
    total: dict[str, int] = {}
    for name in sorted(n for n in changed if is_quantized_linear(n)):
        kind = name.rsplit(".", 2)[-2]  # "q_proj", "down_proj", ...
        group = "uaq_scaled" if uaq_scaled(name) else "unscaled"
        for key in ("all", group, kind):
            flips[key] = flips.get(key, 0) + changed[name]
            total[key] = total.get(key, 0) + numel[name]
    return {key: flips[key] / total[key] for key in flips}
