"""Where an HF tensor lives inside an SGLang server's parameters, and the control chunks qurl's
delta / verified syncs carry to the server.

qurl sends weights under their HF names (`model.layers.0.self_attn.q_proj.weight`, its
`weight_scale` / `weight_scale_inv`, biases, norms, the embedding). SGLang 0.5.23 holds them
differently, and a server that applies a delta or proves what it holds must find each HF tensor
in its own parameters:

- **fusion**: q/k/v are rows of one `qkv_proj` parameter, gate/up of one `gate_up_proj`
  (`models/qwen2.py` / `llama.py` stacked_params_mapping), in that order along the output dim;
  the layer records each part's rows in `output_partition_sizes`. Per-channel scales ([out, 1])
  and biases fuse the same way; block-FP8 scales (`weight_scale_inv`, one per 128x128 tile) fuse
  in tiles: a part of s rows has s / 128 scale rows;
- **vocabulary padding**: `embed_tokens` / `lm_head` hold the vocabulary padded to a multiple of
  64 rows (`VocabParallelEmbedding`), the HF rows first;
- **W8A8 transposition**: `w8a8_int8` / `w8a8_fp8` hold each weight transposed ([in, out]) after
  loading; qurl's restore (loader.py) gives back the [out, in] view of the same
  storage, which is the layout everything here reads and writes (always inside an update session,
  after the restore);
- TP slicing: a rank of a TP size T > 1 server holds only its box of each HF tensor
  (tp_cut.py: rows, or columns of a row-parallel layer, or the whole tensor).
  Its parameter holds that box exactly where it would hold the whole tensor at T = 1 (each fused
  part's rows are the rank's rows of that part; a vocabulary rank's rows come first), so the
  functions below are called with the box's shape instead of the HF shape.

So every HF tensor (or a rank's box of it) is a contiguous row range of one parameter:
`hf_rows(...)` says which, `hf_view` returns it (a view: writing it writes the parameter in
place).

Control chunks (uint8 tensors holding UTF-8 JSON, under names no model has), which ride the
weight broadcast itself, so they reach the in-server loader (apply.py)
through the same `update_weights_from_distributed` path as the weights:

    qurl.sync.header  first chunk of every sync: {"version": v, "base": [v-1, digest] | null}
    qurl.sync.verify  {"version": v, "digests": {hf name: [hex digest, shape, dtype]},
                       "tp": {T: {hf name: [hex digest of rank r's box, r = 0..T-1]}}}
                      ("tp" only for servers with TP size T > 1)
    qurl.sync.kernels the same message, in a session of its own after the sync: the server
                      compares the tensors its kernels read, after the repack (kernels.py)
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import torch

HEADER = "qurl.sync.header"
VERIFY = "qurl.sync.verify"
KERNELS = "qurl.sync.kernels"  # the post-repack read-back (readback.py)
CONTROL = (HEADER, VERIFY, KERNELS)
# the server's refusals, as they come back in the HTTP reply's message
STALE_MARK = "qurl-stale-base:"
MISMATCH_MARK = "qurl-mismatch:"

# HF projection -> (SGLang fused projection, index of the part in it)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def json_chunk(obj: Any) -> torch.Tensor:
    """uint8 [n]: the UTF-8 JSON of obj (a control chunk's payload)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def read_json_chunk(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.detach().cpu().contiguous().view(torch.uint8).numpy()).decode())


def sglang_name(hf_name: str) -> tuple[str, int | None]:
    """HF tensor name -> (SGLang parameter name, part index in a fused parameter or None).
    `model.layers.3.self_attn.k_proj.weight_scale` -> (`model.layers.3.self_attn.qkv_proj.
    weight_scale`, 1); `model.norm.weight` -> (`model.norm.weight`, None)."""
    pieces = hf_name.split(".")
    for i, p in enumerate(pieces):
        if p in FUSED:
            fused, idx = FUSED[p]
            return ".".join(pieces[:i] + [fused] + pieces[i + 1:]), idx
    return hf_name, None


def part_rows(sizes: Sequence[int], rows: int) -> list[tuple[int, int]]:
    """(first row, row count) of each fused part inside a parameter of `rows` rows, given the
    parts' output sizes (the layer's `output_partition_sizes`). rows == sum(sizes) for weights,
    per-channel scales and biases; rows == sum(sizes) / b for per-tile scales of b-row tiles
    (every part a multiple of b). ValueError otherwise."""
    total = sum(sizes)
    if rows <= 0 or total % rows or any(s % (total // rows) for s in sizes):
        raise ValueError(f"a parameter of {rows} rows does not hold parts {list(sizes)}")
    unit = total // rows
    out, start = [], 0
    for s in sizes:
        out.append((start, s // unit))
        start += s // unit
    return out


def hf_rows(part: int | None, sizes: Sequence[int] | None, param_rows: int,
            hf_shape: Sequence[int]) -> tuple[int, int]:
    """(first row, row count) of an HF tensor of `hf_shape` in its parameter (param_rows rows).
    part None: an unfused tensor, its rows first (a padded vocabulary keeps its padding after).
    ValueError when it does not fit."""
    n = int(hf_shape[0]) if len(hf_shape) else 1
    if part is None:
        start = 0
    else:
        if not sizes or part >= len(sizes):
            raise ValueError(f"part {part} of a parameter with parts {sizes}")
        start, count = part_rows(sizes, param_rows)[part]
        if count != n:
            raise ValueError(f"part {part} has {count} rows in the parameter, the HF tensor {n}")
    if start + n > param_rows:
        raise ValueError(f"rows {start}..{start + n} outside a parameter of {param_rows} rows")
    return start, n


def hf_view(param: torch.Tensor, part: int | None, sizes: Sequence[int] | None,
            hf_shape: Sequence[int]) -> torch.Tensor:
    """The HF tensor's elements inside `param` (loading layout, [out, ...]), shaped `hf_shape`:
    a view (same storage) when contiguous. ValueError when the trailing dims differ."""
    hf_shape = tuple(int(d) for d in hf_shape)
    if param.dim() == 0 or len(hf_shape) == 0:
        if param.numel() != 1 or (len(hf_shape) and hf_shape != (1,)):
            raise ValueError(f"a {tuple(param.shape)} parameter for an HF {hf_shape} tensor")
        return param.reshape(hf_shape)
    start, n = hf_rows(part, sizes, param.shape[0], hf_shape)
    rows = param.narrow(0, start, n)
    if tuple(rows.shape) != hf_shape:
        if rows.numel() != torch.Size(hf_shape).numel():
            raise ValueError(f"rows {start}..{start + n} of a {tuple(param.shape)} parameter "
                             f"do not hold an HF {hf_shape} tensor")
        rows = rows.reshape(hf_shape)  # a scale held [out] for an HF [out, 1]
    return rows
