"""How close a checkpoint's weights sit to the INT8 rounding boundaries: why the first sync flips more.

A weight w of a row with per-channel scale σ = absmax/127 rounds to round(w/σ); it flips code when
an update moves it across a boundary (k + ½)·σ. If weights were spread smoothly over the grid, the
share within distance δ of a boundary would be ≈ 2δ/σ, and an update of size δ in a random direction
would flip about half of those. A checkpoint stored in bf16 — this one also de-quantized from a
4-bit GGUF — is a lattice: a share of its weights sits *exactly* on a tie (w/σ = k + ½, which
round-half-to-even sends to the even code), so the first update of any size, in the right
direction, flips them all. After that step they are off the lattice and the flip rate drops to
the smooth-spread rate.

    python -m qurl.research.studies.grid_ties [--model smollm2-135m] [--deltas 1e-6 2e-6 5e-6 1e-5]

prints, over the 7 linears of every layer (UAQ off), the share of weights exactly on a tie and the
share within δ of a boundary, per δ.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

import torch


def boundary_counts(w: torch.Tensor, deltas: Iterable[float]) -> dict[str, int]:
    """For w: [out, in] (any float dtype, computed in fp32 as the quantizer does), the number of
    elements exactly on an INT8 rounding tie ("ties") and within δ (absolute, in w's units) of one
    ("within:<δ>"), plus "elements". A zero row has no boundary (scale 1, all codes 0)."""
    x = w.detach().float()
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    y = x / scale
    dist = ((y - torch.floor(y)) - 0.5).abs() * scale  # to the nearest (k + 1/2)·σ
    out = {"elements": x.numel(), "ties": int((dist == 0).sum())}
    for d in deltas:
        out[f"within:{d:g}"] = int((dist < d).sum())
    return out


def main(argv: list[str] | None = None) -> int:
    from qurl.models.hf import read_state_dict
    from qurl.models.registry import resolve_base
    from qurl.quant.named import is_quantized_linear

    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.grid_ties", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--deltas", type=float, nargs="+", default=[1e-6, 2e-6, 5e-6, 1e-5])
    a = p.parse_args(argv)
    total: dict[str, int] = {}
    for name, w in read_state_dict(resolve_base(a.model)).items():
        if is_quantized_linear(name):
            for k, v in boundary_counts(w, a.deltas).items():
                total[k] = total.get(k, 0) + v
    n = total.pop("elements")
    print(f"{a.model}: {n:,} linear weights; share exactly on an INT8 tie {total.pop('ties') / n:.4%}")
    for k, v in total.items():
        print(f"  within {k.split(':')[1]} of a boundary: {v / n:.4%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
