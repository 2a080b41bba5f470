"""Mixture-of-Experts weights in SGLang's fused layout, and their 8-bit codes per expert.

A Qwen3-MoE layer N has E experts, each a SwiGLU MLP of width I over hidden size H. A checkpoint
(and the learner's `named_weights`) names them one by one,

    model.layers.N.mlp.experts.e.gate_proj.weight  [I, H]
    model.layers.N.mlp.experts.e.up_proj.weight    [I, H]
    model.layers.N.mlp.experts.e.down_proj.weight  [H, I]

while a rollout engine holds them fused per layer, the layout SGLang's `FusedMoE` keeps
(sglang 0.5.23 srt/layers/moe/fused_moe_triton/layer.py: `w13_weight`, `w2_weight`, whose
`weight_loader` writes shard "w1" (gate) into rows [0, I), "w3" (up) into rows [I, 2I) of expert
e's slice, and "w2" (down) whole):

    model.layers.N.mlp.experts.w13_weight  [E, 2I, H]   expert e: gate rows, then up rows
    model.layers.N.mlp.experts.w2_weight   [E, H, I]

8-bit formats quantize each expert's rows exactly as a dense linear's (qurl/quant/formats.py):
- int8 / fp8 per output channel: codes of the same shape, fp32 scales `<name>_scale` [E, rows, 1]
  (SGLang's w8a8_int8 / w8a8_fp8 MoE methods: `w13_weight_scale` [E, 2I, 1], `w2_weight_scale`
  [E, H, 1]); one row of one expert has one scale, so the fused codes equal the per-expert ones.
- fp8_block (128 x 128 tiles): `<name>_scale_inv` [E, ceil(rows/128) ..., ceil(cols/128)]; w13's
  gate and up halves are tiled apart ([E, 2 ceil(I/128), ceil(H/128)], SGLang's Fp8MoEMethod
  block shape), so a tile never straddles gate and up rows.

`fuse_experts` groups a lazy stream of per-expert names into the fused tensors (one layer held at a
time; a layer is complete when the stream moves past it), `split_experts` undoes it. Every fused
expert tensor (codes, scales, or full precision) is verified one expert slice at a time
(qurl/weights/digest.py `expert_sliced`): a gate/up row swap inside one expert keeps every
shape and size, and only a digest of that expert's bytes sees it.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from qurl.quant.formats import dequantize_fp8_block, quantize_fp8_block, quantize_per_channel

W13, W2 = "w13_weight", "w2_weight"
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(w13|w2)_weight$")


def is_fused_expert(name: str) -> bool:
    """True for a layer's fused expert weight (`…mlp.experts.w13_weight` / `w2_weight`)."""
    return _FUSED.match(name) is not None


def per_expert_name(name: str) -> tuple[str, int, str] | None:
    """(layer's `…mlp.experts.` prefix, expert index, "gate" | "up" | "down") of a per-expert
    checkpoint name, else None."""
    m = _PER_EXPERT.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def _fused_layer(prefix: str, got: dict[tuple[int, str], torch.Tensor]
                 ) -> list[tuple[str, torch.Tensor]]:
    n = 1 + max(e for e, _ in got)
    missing = [f"{prefix}{e}.{p}_proj.weight" for e in range(n) for p in ("gate", "up", "down")
               if (e, p) not in got]
    if missing:
        raise ValueError(f"{missing[0]}: missing from the experts of its layer "
                         f"({len(missing)} of {3 * n} tensors missing)")
    w13 = torch.stack([torch.cat([got[(e, "gate")], got[(e, "up")]]) for e in range(n)])
    w2 = torch.stack([got[(e, "down")] for e in range(n)])
    return [(prefix + W13, w13), (prefix + W2, w2)]


def fuse_experts(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert names -> `w13_weight` [E, 2I, H] and `w2_weight` [E, H, I] per layer, lazily.

    A layer's experts are yielded fused where the stream first leaves them (the next name that is
    not one of its experts, or the end); every other tensor passes through in order. A layer whose
    experts come back after it was left, or that lacks one expert's gate, up or down, is a
    ValueError naming the tensor. Dense models pass through unchanged."""
    prefix: str | None = None
    got: dict[tuple[int, str], torch.Tensor] = {}
    done: set[str] = set()
    for name, t in named:
        parts = per_expert_name(name)
        if parts is not None and parts[0] == prefix:
            got[(parts[1], parts[2])] = t
            continue
        if prefix is not None:
            yield from _fused_layer(prefix, got)
            done.add(prefix)
            prefix, got = None, {}
        if parts is None:
            yield name, t
            continue
        if parts[0] in done:
            raise ValueError(f"{name}: its layer's experts were already fused (experts of one layer "
                             "must come together)")
        prefix, got = parts[0], {(parts[1], parts[2]): t}
    if prefix is not None:
        yield from _fused_layer(prefix, got)


def split_experts(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of `fuse_experts` (full-precision fused weights -> per-expert names, views)."""
    for name, t in named:
        m = _FUSED.match(name)
        if m is None:
            yield name, t
            continue
        prefix = name[: -len(W13 if m.group(1) == "w13" else W2)]
        for e, w in enumerate(t):
            if m.group(1) == "w13":
                gate, up = w.chunk(2, dim=0)
                yield f"{prefix}{e}.gate_proj.weight", gate
                yield f"{prefix}{e}.up_proj.weight", up
            else:
                yield f"{prefix}{e}.down_proj.weight", w


def quantize_experts(w: torch.Tensor, fmt: str,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert, per-output-channel codes of a fused expert weight.

    w: [E, rows, cols] -> (codes [E, rows, cols], scale [E, rows, 1] fp32), fmt "int8" | "fp8";
    `out` writes into given tensors (the weight sync's wire views). Equal, expert by expert, to
    `quantize_per_channel(w[e], fmt)`."""
    if w.dim() != 3:
        raise ValueError(f"fused experts must be 3-D [E, rows, cols], got {tuple(w.shape)}")
    E, R, C = w.shape
    flat_out = None if out is None else (out[0].view(E * R, C), out[1].view(E * R, 1))
    codes, scale = quantize_per_channel(w.reshape(E * R, C), fmt, out=flat_out)  # type: ignore[arg-type]
    return (codes.view(E, R, C), scale.view(E, R, 1)) if out is None else out


def quantize_experts_block(w: torch.Tensor, w13: bool, block: int = 128
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 128-block codes of a fused expert weight, each expert (and w13's gate and up halves)
    tiled on its own: w [E, rows, cols] -> (codes [E, rows, cols] float8_e4m3fn,
    scale_inv [E, row tiles, col tiles] fp32; row tiles = 2 ceil(I/block) for w13)."""
    codes, scales = [], []
    for we in w:
        halves = we.chunk(2, dim=0) if w13 else (we,)
        qs = [quantize_fp8_block(h, block) for h in halves]
        codes.append(torch.cat([c for c, _ in qs]))
        scales.append(torch.cat([s for _, s in qs]))
    return torch.stack(codes), torch.stack(scales)


def dequantize_experts_block(codes: torch.Tensor, scale_inv: torch.Tensor, w13: bool,
                             block: int = 128, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_experts_block`: [E, rows, cols] in `dtype`."""
    out = []
    for c, s in zip(codes, scale_inv):
        halves = list(zip(c.chunk(2), s.chunk(2))) if w13 else [(c, s)]
        out.append(torch.cat([dequantize_fp8_block(hc, hs, block, dtype) for hc, hs in halves]))
    return torch.stack(out)
