"""Which slice of each HF tensor a TP rank of an SGLang 0.5.23 server holds (tensor parallelism).

A server launched with `--tp-size T` runs T scheduler processes (ranks); rank r holds only its
slice of each weight, cut by SGLang's own loaders (paths inside the wheel,
`sglang/srt/layers/`):

- **column-parallel** (`linear.py`: `MergedColumnParallelLinear` for gate/up,
  `QKVParallelLinear` for q/k/v): the output dim (rows, [out, in]) is cut into T equal chunks,
  rank r takes chunk r — for the weight, its bias, the per-channel W8A8 scale ([out, 1],
  `quantization/w8a8_int8.py` / `w8a8_fp8.py`: a `ChannelQuantScaleParameter` with
  `output_dim=0`) and the block-FP8 tile scales ([out/128, in/128], `quantization/fp8.py`:
  `BlockQuantScaleParameter`, cut in whole tiles: SGLang refuses to start unless every rank's
  part is a multiple of 128 rows);
- **k/v heads** (`QKVParallelLinear.__init__` / `weight_loader`): with Hkv >= T key/value
  heads, rank r takes heads [r Hkv/T, (r+1) Hkv/T) like any column; with Hkv < T each head is
  *replicated* on T/Hkv ranks (`num_kv_head_replicas`) and rank r holds head r // (T/Hkv)
  (`shard_id = kv_tp_rank // num_kv_head_replicas`). Both: the rows are cut into
  n = min(Hkv, T) chunks and rank r takes chunk r*n // T;
- **row-parallel** (`RowParallelLinear`: o_proj, down_proj): the input dim (columns) is cut into
  T chunks, rank r takes chunk r — the weight and the block-FP8 tile scales (`input_dim=1`);
  the per-channel scale [out, 1] and the bias have no input dim: every rank holds them whole;
- **vocabulary** (`vocab_parallel_embedding.py`: `VocabParallelEmbedding`, `ParallelLMHead`):
  the vocabulary V is padded to P, a multiple of 64 (of 64*T when pad(V, 64) is not a multiple
  of T), each rank owns P/T padded rows: rank r holds the real rows [min(r P/T, V),
  min((r+1) P/T, V)) at the start of its parameter, zeros after (a rank may hold none);
- everything else qurl sends (RMSNorm weights, `*norm.weight`) is replicated.

At T = 1 every tensor is whole. The slice is a box of the HF tensor seen as [rows, cols]:
`Box.rows` / `Box.cols` = (start, count). Both ends call the same functions: the learner hashes
each rank's box of each tensor (`rank_digests`), and a server rank finds its box in its
parameter (apply.py: the box is what the part's rows of the rank's
parameter hold, found by layout.py as at T = 1) and keeps only the delta
positions inside it, re-indexed (`local_positions`). A name or shape this map does not know is a
ValueError: such a server gets full, unverified syncs.

Only what qurl's models use is mapped (Llama / Qwen2 / Qwen3 dense layers, no presharded or
padded-shard loading; every cut must be exact). SGLang's CPU path (`--device cpu`,
`configs/update_config.py: adjust_config_with_unaligned_cpu_tp`) does not replicate k/v heads:
when T does not divide the query or key/value head count it PADS both with zero heads, and it
pads the SwiGLU size to a multiple of T * 32 (T * 128 for block FP8); `cpu_padding` says when that
happens, and such servers get full syncs (the replication above is the GPU path's rule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from qurl.weights.digest import tensor_digest

VOCAB_PAD = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)
CPU_MLP_PAD = 32  # SGLang's DEFAULT_MOE_PADDING_SIZE (configs/update_config.py), per rank
COLUMN = ("q_proj", "gate_proj", "up_proj")
KV = ("k_proj", "v_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")
LINEAR_PARAMS = ("weight", "bias", "weight_scale", "weight_scale_inv")


@dataclass(frozen=True)
class Layout:
    """What the cut depends on besides the shapes: the attention's head counts."""
    heads: int
    kv_heads: int
    vocab_pad: int = VOCAB_PAD

    @classmethod
    def of_config(cls, cfg: Any) -> "Layout | None":
        """From an HF config (dict or object): num_attention_heads, num_key_value_heads (None
        when it has no head count)."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        heads = get("num_attention_heads", None)
        if not isinstance(heads, int) or heads <= 0:
            return None
        kv = get("num_key_value_heads", None)
        return cls(heads, kv if isinstance(kv, int) and kv > 0 else heads)


@dataclass(frozen=True)
class Box:
    """Rows (start, count) and columns (start, count, or None = all) of an HF tensor."""
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None


def whole(shape: Sequence[int]) -> Box:
    return Box((0, int(shape[0]) if len(shape) else 1))


def _chunk(n_rows: int, n: int, c: int, what: str) -> tuple[int, int]:
    if n_rows % n:
        raise ValueError(f"{what}: {n_rows} rows do not split into {n} equal TP chunks")
    size = n_rows // n
    return c * size, size


def vocab_rows(vocab: int, rank: int, tp: int, pad: int = VOCAB_PAD) -> tuple[int, int]:
    """(first HF row, row count) of the vocabulary rank `rank` of `tp` holds (module docstring)."""
    padded = -(-vocab // pad) * pad
    if padded % tp:
        pad *= tp
        padded = -(-vocab // pad) * pad
    per = padded // tp
    start, end = min(rank * per, vocab), min((rank + 1) * per, vocab)
    return start, end - start


def shard_box(name: str, shape: Sequence[int], rank: int, tp: int, layout: Layout | None) -> Box:
    """The box of HF tensor `name` ([rows] or [rows, cols]) that TP rank `rank` of `tp` holds.
    ValueError for a name, shape or head count this map cannot cut exactly."""
    shape = tuple(int(d) for d in shape)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} of a TP size {tp}")
    if tp == 1:
        return whole(shape)
    if layout is None:
        raise ValueError("no TP layout: the model's head counts are unknown here, or SGLang "
                         "padded the cut")
    if len(shape) not in (1, 2):
        raise ValueError(f"{name}: a {len(shape)}-dim tensor has no TP layout here")
    pieces = name.split(".")
    module, param = (pieces[-2] if len(pieces) > 1 else ""), pieces[-1]
    if name.endswith("norm.weight"):
        return whole(shape)
    if module in VOCAB and param == "weight":
        return Box(vocab_rows(shape[0], rank, tp, layout.vocab_pad))
    if param not in LINEAR_PARAMS or module not in COLUMN + KV + ROW:
        raise ValueError(f"{name}: no TP layout for this tensor")
    if module in ROW:  # input dim cut: weight and tile scales; [out, 1] scale and bias whole
        if param in ("weight", "weight_scale_inv") and len(shape) == 2:
            return Box((0, shape[0]), _chunk(shape[1], tp, rank, name + " (columns)"))
        return whole(shape)
    if module in KV:
        h = layout.kv_heads
        if (h % tp if h >= tp else tp % h):
            raise ValueError(f"{name}: {h} key/value heads and TP size {tp}: neither divides")
        n = min(h, tp)
        return Box(_chunk(shape[0], n, rank * n // tp, name))
    if module == "q_proj" and layout.heads % tp:
        raise ValueError(f"{name}: {layout.heads} heads do not split over TP size {tp}")
    return Box(_chunk(shape[0], tp, rank, name))


def cpu_padding(layout: Layout, tp: int, intermediate: int | None, block_n: int | None
                ) -> str | None:
    """Why SGLang's CPU path would pad this model's cut at TP size `tp` (module docstring), or
    None when it does not."""
    if layout.heads % tp or layout.kv_heads % tp:
        return (f"SGLang's CPU path pads {layout.heads} query / {layout.kv_heads} key-value heads "
                f"to multiples of TP {tp} with zero heads")
    unit = tp * (block_n or CPU_MLP_PAD)
    if intermediate is not None and intermediate % unit:
        return f"SGLang's CPU path pads the SwiGLU size {intermediate} to a multiple of {unit}"
    return None


def slice_shape(shape: Sequence[int], box: Box) -> tuple[int, ...]:
    """Shape of the box of a tensor of `shape` (same number of dims)."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        return shape
    out = (box.rows[1],) + shape[1:]
    if box.cols is not None:
        out = (out[0], box.cols[1]) + out[2:]
    return out


def take(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The box of t (a view)."""
    if t.dim() == 0:
        return t
    out = t.narrow(0, *box.rows)
    return out if box.cols is None else out.narrow(1, *box.cols)


def local_positions(pos: torch.Tensor, val: torch.Tensor, shape: Sequence[int], box: Box
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A delta's flat positions int64 [k] (ascending) in the HF tensor of `shape` -> those inside
    `box`, as flat positions of the box (C order) with their values. Rows only: one contiguous
    range of positions (two binary searches); a column cut: a filter by column, re-indexed."""
    shape = tuple(int(d) for d in shape)
    cols = 1
    for d in shape[1:]:
        cols *= d
    r0, nr = box.rows
    lo, hi = torch.searchsorted(pos, torch.tensor([r0 * cols, (r0 + nr) * cols],
                                                  dtype=pos.dtype)).tolist()
    pos, val = pos[lo:hi], val[lo:hi]
    if box.cols is None:
        return pos - r0 * cols, val
    c0, nc = box.cols  # a column cut: 2-dim tensors only (shard_box)
    row, col = pos // cols, pos % cols
    keep = (col >= c0) & (col < c0 + nc)
    local = (row[keep] - r0) * nc + (col[keep] - c0)
    return local, val[keep]


def rank_digests(name: str, t: torch.Tensor, tp: int, layout: Layout | None) -> list[str]:
    """Digest (qurl/weights/digest.py) of each rank's box of HF tensor t, rank 0 first: what the
    learner sends a TP-`tp` server to verify against (ValueError if t cannot be cut)."""
    return [tensor_digest(take(t, shard_box(name, t.shape, r, tp, layout))) for r in range(tp)]
