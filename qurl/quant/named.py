"""Quantize a stream of named HF weights into the chunks an 8-bit rollout engine loads.

At every weight sync the learner walks its weights as `(HF name, tensor)` pairs. The decoder-layer
linears (`model.layers.N.self_attn.{q,k,v,o}_proj.weight`, `model.layers.N.mlp.{gate,up,down}_proj.weight`)
are replaced by two chunks, the W8A8 layout SGLang holds:

    (name, codes [out, in] int8 | float8_e4m3fn), (name + "_scale", scale [out, 1] fp32)

e.g. `model.layers.0.self_attn.q_proj.weight` and `model.layers.0.self_attn.q_proj.weight_scale`;
with fmt "fp8_block" (SGLang's `fp8` method with `weight_block_size` [128, 128]) the scale is one per
128x128 tile, under SGLang's name for it:

    (name, codes [out, in] float8_e4m3fn), (name + "_scale_inv", scale [ceil(out/128), ceil(in/128)] fp32)

A Qwen3-MoE's experts are linears too: per expert under their checkpoint names
(`model.layers.N.mlp.experts.e.{gate,up,down}_proj.weight`), or fused per layer into SGLang's
`mlp.experts.w13_weight` [E, 2I, H] / `w2_weight` [E, H, I] with scales [E, rows, 1] (or per expert
tiles, `_scale_inv`), which is what `engine_chunks` hands the engines (experts.py). The
router (`mlp.gate.weight`) is not a quantized linear: SGLang keeps it in full precision.

Everything else (embeddings, lm_head, norms, biases) passes through untouched: those stay in full
precision in a W8A8 model. With fmt "bf16" nothing is quantized (the full-precision rollout baseline).
With fmt "w4a16" (the study's weight-only stress format, qurl.quant.int4) the codes are int8 values
in [-7, 7] and `_scale` holds one fp32 scale per group of 128 input columns: [out, in // 128]
(gcd(in, 128) columns where 128 does not tile the row: qurl.quant.int4.int4_group).

Invariant: `dequantize_named(dict(quantize_named(chunks, fmt)))` has exactly the names of `chunks`,
with linears equal to their quantization round trip and everything else identical.

`quantize_named` is the one quantizer of every path to an engine: `engine_chunks` (below) adds the
dtype each chunk travels in (`travels_as`) for checkpoints and tests, and the weight sync writes
the same values into its wire buckets (qurl/weights/arena.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

from qurl.quant.experts import (W13, dequantize_experts_block, fuse_experts, is_fused_expert,
                                quantize_experts, quantize_experts_block)
from qurl.quant.formats import (FORMATS, dequantize_fp8_block, dequantize_per_channel,
                                quantize_fp8_block, quantize_per_channel)
from qurl.quant.int4 import dequantize_int4_groups, int4_group, quantize_int4_groups

SCALE_SUFFIX = "_scale"
BLOCK_SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = 128
NAMED_FORMATS: tuple[str, ...] = (*FORMATS, "fp8_block", "w4a16", "bf16")

_LINEAR_RE = re.compile(
    r"^model\.layers\.\d+\.(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:experts\.\d+\.)?(?:gate|up|down)_proj)"
    r"\.weight$"
)


def is_quantized_linear(name: str) -> bool:
    """True for the decoder-layer linear weights W8A8 quantizes: q/k/v/o, gate/up/down (dense, or
    one MoE expert's `mlp.experts.e.{gate,up,down}_proj.weight`), and a MoE layer's fused experts
    (`mlp.experts.w13_weight` / `w2_weight`, experts.py). Never the router
    (`mlp.gate.weight`): SGLang keeps it in full precision."""
    return _LINEAR_RE.match(name) is not None or is_fused_expert(name)


def quantize_named(
    chunks: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], fmt: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the engine-ready chunks for `chunks` in format `fmt` ("int8", "fp8", "fp8_block",
    "w4a16", "bf16").

    Lazy: one input chunk is quantized at a time, so a sync never holds two copies of the model.
    """
    if fmt not in NAMED_FORMATS:
        raise ValueError(f"fmt must be one of {NAMED_FORMATS}, got {fmt!r}")
    items = chunks.items() if isinstance(chunks, Mapping) else chunks
    for name, tensor in items:
        if fmt != "bf16" and is_quantized_linear(name):
            try:
                if is_fused_expert(name):
                    if fmt not in FORMATS and fmt != "fp8_block":
                        raise ValueError(f"fused experts have no {fmt} format")
                    codes, scale = (quantize_experts_block(tensor, name.endswith(W13), FP8_BLOCK)
                                    if fmt == "fp8_block" else quantize_experts(tensor, fmt))
                elif fmt == "fp8_block":
                    codes, scale = quantize_fp8_block(tensor, FP8_BLOCK)
                elif fmt == "w4a16":
                    codes, scale = quantize_int4_groups(tensor, int4_group(tensor.shape[1]))
                else:
                    codes, scale = quantize_per_channel(tensor, fmt)  # type: ignore[arg-type]
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from err
            yield name, codes
            yield name + (BLOCK_SCALE_SUFFIX if fmt == "fp8_block" else SCALE_SUFFIX), scale
        else:
            yield name, tensor


def travels_as(name: str, t: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype engine chunk `name` is sent in. 8-bit codes, their scales (always fp32) and
    non-floating tensors keep theirs; the full-precision pass-throughs (embeddings, lm_head, norms,
    biases; every weight with fmt "bf16") travel as `wire_dtype`, the dtype the engine holds them
    in (an SGLang server's bf16 or fp16: half the bytes of fp32 masters), or as they are when it
    is None (see qurl.engines.factory.engine_wire_dtype)."""
    if (wire_dtype is None or not t.is_floating_point()
            or t.dtype in (torch.int8, torch.float8_e4m3fn) or _scale_owner(name) is not None):
        return t.dtype
    return wire_dtype


ENGINE_FORMATS = ("bf16", "int8", "fp8", "fp8_block", "none")


def engine_chunks(named: Iterable[tuple[str, torch.Tensor]], fmt: str,
                  wire_dtype: torch.dtype | None = None, *, fuse: bool = True
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The chunks an engine of format `fmt` loads, lazily, one input tensor at a time (a MoE
    layer's experts: one layer at a time, fused into SGLang's `w13_weight` / `w2_weight` and
    quantized per expert, experts.py, at every format, bf16 included). fuse=False
    keeps the experts under their per-expert checkpoint names, each quantized as a linear (what an
    8-bit checkpoint holds: qurl/models/export8bit.py).

    Scales are always fp32 and 8-bit codes keep their dtype; every other floating tensor is cast
    to `wire_dtype` when given (bf16 for fmt "bf16" by default); see `quant.named.travels_as`.
    """
    if fmt not in ENGINE_FORMATS:
        raise ValueError(f"fmt={fmt!r}: must be one of {', '.join(ENGINE_FORMATS)}")
    if fmt == "bf16" and wire_dtype is None:
        wire_dtype = torch.bfloat16
    for name, t in (fuse_experts(named) if fuse else named):
        quantized = fmt in ("int8", "fp8", "fp8_block")
        out = list(quantize_named([(name, t)], fmt)) if quantized else [(name, t)]
        for n, x in out:
            dtype = x.dtype if fmt == "none" else travels_as(n, x, wire_dtype)
            yield n, x if x.dtype == dtype else x.to(dtype)


def dequantize_named(
    named: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK
) -> dict[str, torch.Tensor]:
    """Inverse of `quantize_named`: fold every (codes, `_scale`) pair back into one `dtype` weight.

    Tensors without a scale partner that are not 8-bit codes pass through unchanged.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        base = _scale_owner(name)
        if base is not None and is_quantized_linear(base):
            if base not in named:
                raise ValueError(f"{name}: scale without its codes {base!r}")
            continue
        if tensor.dtype in (torch.int8, torch.float8_e4m3fn):
            scale = named.get(name + SCALE_SUFFIX)
            if scale is not None and scale.dim() == 2 and scale.shape[1] > 1:  # int4 groups
                out[name] = dequantize_int4_groups(tensor, scale, dtype)
            elif scale is not None and tensor.dim() == 3:  # fused experts, per expert and row
                out[name] = (tensor.to(torch.float32) * scale.to(torch.float32)).to(dtype)
            elif scale is not None:
                out[name] = dequantize_per_channel(tensor, scale, dtype)
            elif name + BLOCK_SCALE_SUFFIX in named and tensor.dim() == 3:
                out[name] = dequantize_experts_block(tensor, named[name + BLOCK_SCALE_SUFFIX],
                                                     name.endswith(W13), block, dtype)
            elif name + BLOCK_SCALE_SUFFIX in named:
                out[name] = dequantize_fp8_block(tensor, named[name + BLOCK_SCALE_SUFFIX], block, dtype)
            else:
                raise ValueError(f"{name} has 8-bit codes but no {SCALE_SUFFIX}/{BLOCK_SCALE_SUFFIX} "
                                 "(codes without a scale)")
        else:
            out[name] = tensor
    return out


def _scale_owner(name: str) -> str | None:
    """The weight a scale chunk belongs to (`…weight_scale` / `…weight_scale_inv` -> `…weight`)."""
    for suffix in (BLOCK_SCALE_SUFFIX, SCALE_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None
