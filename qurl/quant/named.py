"""Quantize a stream of named HF weights into the chunks an 8-bit rollout engine loads.

At every weight sync the learner walks its weights as `(HF name, tensor)` pairs. The decoder-layer
linears (`model.layers.N.self_attn.{q,k,v,o}_proj.weight`, `model.layers.N.mlp.{gate,up,down}_proj.weight`)
are replaced by two chunks, the W8A8 layout SGLang holds:

    (name, codes [out, in] int8 | float8_e4m3fn), (name + "_scale", scale [out, 1] fp32)

e.g. `model.layers.0.self_attn.q_proj.weight` and `model.layers.0.self_attn.q_proj.weight_scale`.
Everything else (embeddings, lm_head, norms, biases) passes through untouched: those stay in full
precision in a W8A8 model. With fmt "bf16" nothing is quantized (the full-precision rollout baseline).

Invariant: `dequantize_named(dict(quantize_named(chunks, fmt)))` has exactly the names of `chunks`,
with linears equal to their per-channel round trip and everything else identical.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

from qurl.quant.formats import FORMATS, dequantize_per_channel, quantize_per_channel

SCALE_SUFFIX = "_scale"
NAMED_FORMATS: tuple[str, ...] = (*FORMATS, "bf16")

_LINEAR_RE = re.compile(
    r"^model\.layers\.\d+\.(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.weight$"
)


def is_quantized_linear(name: str) -> bool:
    """True for HF Qwen2/Llama decoder-layer linear weights (q/k/v/o, gate/up/down), the ones W8A8 quantizes."""
    return _LINEAR_RE.match(name) is not None


def quantize_named(
    chunks: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], fmt: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the engine-ready chunks for `chunks` in format `fmt` ("int8", "fp8" or "bf16").

    Lazy: one input chunk is quantized at a time, so a sync never holds two copies of the model.
    """
    if fmt not in NAMED_FORMATS:
        raise ValueError(f"fmt must be one of {NAMED_FORMATS}, got {fmt!r}")
    items = chunks.items() if isinstance(chunks, Mapping) else chunks
    for name, tensor in items:
        if fmt != "bf16" and is_quantized_linear(name):
            try:
                codes, scale = quantize_per_channel(tensor, fmt)  # type: ignore[arg-type]
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from err
            yield name, codes
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, tensor


def dequantize_named(
    named: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Inverse of `quantize_named`: fold every (codes, `_scale`) pair back into one `dtype` weight.

    Tensors without a scale partner that are not 8-bit codes pass through unchanged.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        if name.endswith(SCALE_SUFFIX) and is_quantized_linear(name[: -len(SCALE_SUFFIX)]):
            if name[: -len(SCALE_SUFFIX)] not in named:
                raise ValueError(f"{name}: scale without its codes {name[: -len(SCALE_SUFFIX)]!r}")
            continue
        is_codes = tensor.dtype in (torch.int8, torch.float8_e4m3fn)
        if is_codes:
            if name + SCALE_SUFFIX not in named:
                raise ValueError(f"{name}: 8-bit codes without a {name + SCALE_SUFFIX!r} scale")
            out[name] = dequantize_per_channel(tensor, named[name + SCALE_SUFFIX], dtype)
        else:
            out[name] = tensor
    return out
