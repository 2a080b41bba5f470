"""Does UAQ move the starting engine? The 8-bit codes of a checkpoint with and without UAQ scaling.

    python -m qurl.research.studies.uaq_codes CHECKPOINT_DIR [--scales 1.5 2] [--fmt int8]

UAQ (qurl.quant.uaq) divides q/k/v/gate/up by s and multiplies their RMSNorm gains by s. Weights
are quantized per output channel with scale absmax(row)/qmax, and a whole row divided by s has its
scale divided by s too, so in exact arithmetic every code is the same: UAQ changes how far later
updates move on the grid, not the grid position of the starting weights. In fp32 the division
rounds, and a weight that sat within rounding of a code boundary can land on the other side. This
measures that share (codes compared bit for bit, qurl.quant.flips), per projection kind. s = 2 (a
power of two) divides exactly and must change nothing; s = 1.5 changes ~1e-6 of the codes of
SmolLM2-135M's warm starts (docs/study/smollm2_regime.md). Activations and the engine's norm
gains are not covered here: this checks the weight grid only.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping

import torch

from qurl.quant.flips import flip_fractions
from qurl.quant.named import quantize_named
from qurl.quant.uaq import apply_uaq


def code_changes(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], fmt: str = "int8"
                 ) -> dict[str, float]:
    """Share of `fmt` codes of the quantized linears that differ between state dicts `a` and `b`:
    {"all", "uaq_scaled", "unscaled", "<proj>_proj": share} (flip_fractions' groups)."""
    return flip_fractions(dict(quantize_named(a, fmt)), dict(quantize_named(b, fmt)))


def code_shift(state: Mapping[str, torch.Tensor], s: float, fmt: str = "int8") -> dict[str, float]:
    """code_changes between `state` and `apply_uaq(state, s)` (the unscaled layers must give 0)."""
    return code_changes(state, apply_uaq(state, s), fmt)


def main(argv: list[str] | None = None) -> int:
    from qurl.models.hf import read_state_dict

    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.uaq_codes",
                                description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a HF checkpoint directory (Llama/Qwen2 layout)")
    p.add_argument("--scales", type=float, nargs="+", default=[1.5])
    p.add_argument("--fmt", default="int8", choices=["int8", "fp8"])
    a = p.parse_args(argv)
    state = read_state_dict(a.checkpoint)
    for s in a.scales:
        print(json.dumps({"s": s, "fmt": a.fmt, **code_shift(state, s, a.fmt)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
