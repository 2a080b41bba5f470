"""Bytes one weight sync sends, by tensor kind: what goes in 8 bits and what does not.

At every sync the learner's fp32 master weights pass through the sync's own quantizer
(`qurl.weights.publish.WeightSync.quantize`, the code path training uses) and the resulting chunks are
what an engine loads. This module sorts those chunks into kinds and sums their bytes:

- `linear codes`: the 8-bit codes of the 7 decoder-layer linears (1 byte per weight);
- `linear scales`: their fp32 scales (`_scale`: one per output row; `_scale_inv`: one per tile);
- `embedding`: `model.embed_tokens.weight` (with tied embeddings the lm_head is the same tensor and
  is not sent again); `lm_head`: an untied head;
- `norms`: RMSNorm gains; `other`: anything else (biases, ...).

Full-precision tensors travel in the engine's dtype (`qurl.engines.factory.engine_wire_dtype`):
the local engine computes in fp32, so it gets fp32; an SGLang server gets its `--dtype` (for a bf16
checkpoint: bf16), half the bytes.

    python -m qurl.research.studies.sync_bytes [--model smollm2-135m] [--precision int8]
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

import torch

from qurl.quant.named import is_quantized_linear

KINDS = ("linear codes", "linear scales", "embedding", "lm_head", "norms", "other")


def kind_of(name: str, t: torch.Tensor) -> str:
    """The kind (one of KINDS) of an engine chunk."""
    for suffix in ("_scale_inv", "_scale"):
        if name.endswith(suffix) and is_quantized_linear(name[: -len(suffix)]):
            return "linear scales"
    if is_quantized_linear(name):
        return "linear codes" if t.dtype in (torch.int8, torch.float8_e4m3fn) else "other"
    if name.endswith("embed_tokens.weight"):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if name.endswith("norm.weight"):
        return "norms"
    return "other"


def bytes_by_kind(chunks: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict]:
    """{kind: {"bytes", "elements", "dtypes"}} over engine chunks, plus "total" (bytes, elements).

    Full-precision linears (precision bf16) count as "other"."""
    out: dict[str, dict] = {}
    for name, t in chunks:
        row = out.setdefault(kind_of(name, t), {"bytes": 0, "elements": 0, "dtypes": set()})
        row["bytes"] += t.numel() * t.element_size()
        row["elements"] += t.numel()
        row["dtypes"].add(str(t.dtype).replace("torch.", ""))
    out["total"] = {"bytes": sum(r["bytes"] for r in out.values()),
                    "elements": sum(r["elements"] for r in out.values()), "dtypes": set()}
    return out


def measure(model_dir: str, precision: str, wire_dtype: torch.dtype | None) -> dict[str, dict]:
    """Sync the checkpoint's weights (as fp32 masters, the learner's) through WeightSync.quantize
    with `wire_dtype`, and sort the chunks it would load into an engine by kind."""
    from qurl.models.hf import read_state_dict
    from qurl.weights.publish import WeightSync

    # a tied checkpoint holds no lm_head.weight, and the learner's named_weights yields none
    state = {k: v.float() for k, v in read_state_dict(model_dir).items()}
    chunks, _ = WeightSync(precision, wire_dtype=wire_dtype).quantize(iter(state.items()))
    return bytes_by_kind(chunks)


def table(rows: dict[str, dict], title: str) -> str:
    """A markdown table of bytes_by_kind's result."""
    lines = [f"| {title} | dtype | elements | MB (10^6 B) | share |", "| --- | --- | ---: | ---: | ---: |"]
    total = rows["total"]["bytes"]
    for k in (*KINDS, "total"):
        if k in rows:
            r = rows[k]
            lines.append(f"| {k} | {', '.join(sorted(r['dtypes'])) or '–'} | {r['elements']:,} | "
                         f"{r['bytes'] / 1e6:.1f} | {r['bytes'] / total:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from qurl.models.registry import resolve_base

    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.sync_bytes",
                                description="bytes of one weight sync by tensor kind")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--precision", default="int8", choices=("int8", "fp8", "fp8_block", "w4a16"))
    a = p.parse_args(argv)
    model_dir = resolve_base(a.model)
    for label, wire in (("local engine (fp32 compute)", None), ("SGLang, --dtype bf16", torch.bfloat16)):
        print(f"\n{a.precision} sync of {a.model} to the {label}:\n")
        print(table(measure(model_dir, a.precision, wire), "kind"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
