"""Byte-budgeted buckets of named tensors, and their flat byte layout on the wire.

A weight sync moves hundreds of tensors; one collective per tensor is slow, one collective for the
whole model needs a second copy of the model. So the sender groups consecutive tensors into
*buckets* of about `budget_bytes` and broadcasts each bucket as ONE flat `uint8` tensor.

Wire layout of a bucket (identical to SGLang 0.5.23's `load_format="flattened_bucket"` receiver,
`sglang/srt/weight_sync/tensor_bucket.py: FlattenedTensorBucket.empty / reconstruct_tensors`):
the raw bytes of each tensor (C-contiguous, native little-endian) concatenated in the announced
order, no padding, no header. The receiver recomputes every offset from the announced
`names / dtypes / shapes`, and SGLang REFUSES a tensor whose byte offset is not a multiple of its
itemsize ("Unaligned received tensor"). We therefore order the tensors of a bucket by itemsize,
largest first: itemsizes are powers of two and every tensor's size is a multiple of its itemsize,
so every offset is then aligned (fp32 scales, then bf16, then int8/fp8 codes).

Dtypes travel as torch attribute names (`"int8"`, `"float8_e4m3fn"`, `"bfloat16"`, `"float32"`):
SGLang resolves them with `getattr(torch, name)`, so `"torch.int8"` would fail there.

Invariants:
- a *group* (e.g. codes + their `_scale`) is never split across buckets, so an engine that needs
  both halves of a quantized linear gets them together;
- a group larger than the budget gets a bucket of its own (never an error, never split);
- `unpack(pack(tensors, layout), layout)` returns tensors bit-identical to the input.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

# What may cross the wire. Anything else is refused on both ends with the tensor's name.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,  # delta positions (delta.py)
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int32": torch.int32,
    "int64": torch.int64,
}
_NAME_OF = {v: k for k, v in WIRE_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """torch dtype -> wire name (`torch.int8` -> `"int8"`)."""
    if dtype not in _NAME_OF:
        raise ValueError(f"dtype {dtype} cannot be sent (allowed: {', '.join(WIRE_DTYPES)})")
    return _NAME_OF[dtype]


def dtype_from_name(name: str, what: str = "dtype") -> torch.dtype:
    """Wire name -> torch dtype; ValueError naming `what` for anything unknown."""
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise ValueError(f"{what}: unknown dtype {name!r} (allowed: {', '.join(WIRE_DTYPES)})")
    return WIRE_DTYPES[name]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # wire name, see WIRE_DTYPES
    shape: tuple[int, ...]
    offset: int  # byte offset inside the bucket
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    """Where every tensor of one bucket lives in its flat byte buffer."""

    specs: tuple[TensorSpec, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def dtypes(self) -> list[str]:
        return [s.dtype for s in self.specs]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(s.shape) for s in self.specs]

    @staticmethod
    def from_meta(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
                  ) -> "BucketLayout":
        """Rebuild (and validate) a layout from announced metadata, the way a receiver must:
        offsets are recomputed, never trusted. Raises ValueError naming the bad tensor."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"bucket metadata: {len(names)} names, {len(dtypes)} dtypes, "
                             f"{len(shapes)} shapes (must be equal)")
        if not names:
            raise ValueError("bucket metadata: empty bucket")
        specs, offset, seen = [], 0, set()
        for name, dt, shape in zip(names, dtypes, shapes):
            if not isinstance(name, str) or not name:
                raise ValueError(f"bucket metadata: bad tensor name {name!r}")
            if name in seen:
                raise ValueError(f"bucket metadata: tensor {name!r} listed twice")
            seen.add(name)
            torch_dt = dtype_from_name(dt, f"tensor {name!r}")
            if not isinstance(shape, (list, tuple)) or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
            item = torch_dt.itemsize
            if offset % item:
                raise ValueError(f"tensor {name!r}: byte offset {offset} not aligned to {dt}")
            numel = 1
            for d in shape:
                numel *= d
            specs.append(TensorSpec(name, dt, tuple(shape), offset, numel * item))
            offset += numel * item
        return BucketLayout(tuple(specs), offset)


def layout_of(named: Sequence[tuple[str, torch.Tensor]]) -> BucketLayout:
    """Layout of tensors in the given order (caller has already ordered them for alignment)."""
    return BucketLayout.from_meta([n for n, _ in named], [dtype_name(t.dtype) for _, t in named],
                                  [list(t.shape) for _, t in named])


def align_order(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Stable sort by itemsize, largest first, so every byte offset is aligned (module docstring)."""
    return sorted(named, key=lambda nt: -nt[1].element_size())


def pack(named: Sequence[tuple[str, torch.Tensor]], layout: BucketLayout,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the raw bytes of `named` (in layout order) into a uint8 tensor [layout.nbytes].

    `out`, if given, is a uint8 buffer of at least layout.nbytes on the target device (reused
    across buckets to avoid re-allocating); the returned tensor is a view of it.
    """
    if len(named) != len(layout.specs):
        raise ValueError(f"pack: {len(named)} tensors for a layout of {len(layout.specs)}")
    device = named[0][1].device if named else torch.device("cpu")
    if out is None:
        buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    else:
        if out.dtype != torch.uint8 or out.numel() < layout.nbytes:
            raise ValueError(f"pack: out buffer must be uint8 with >= {layout.nbytes} elements")
        buf = out[: layout.nbytes]
    for (name, t), spec in zip(named, layout.specs):
        if name != spec.name or dtype_name(t.dtype) != spec.dtype or tuple(t.shape) != spec.shape:
            raise ValueError(f"pack: tensor {name!r} {t.dtype} {tuple(t.shape)} does not match "
                             f"layout entry {spec.name!r} {spec.dtype} {spec.shape}")
        if spec.nbytes:
            buf[spec.offset: spec.offset + spec.nbytes].copy_(
                t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
    return buf


def bucket_buffer(named: Sequence[tuple[str, torch.Tensor]], layout: BucketLayout
                  ) -> torch.Tensor | None:
    """The uint8 [layout.nbytes] buffer that `named` already fill at their layout offsets (they
    are views of one storage, as arena.py makes them), or None when they do not; then
    `pack` must copy them. Zero copy: the result shares the tensors' storage."""
    if not named or len(named) != len(layout.specs):
        return None
    first = named[0][1]
    storage = first.untyped_storage()
    start = first.storage_offset() * first.element_size() - layout.specs[0].offset
    base = first.data_ptr() - layout.specs[0].offset
    if start < 0 or start + layout.nbytes > storage.nbytes():
        return None
    for (name, t), spec in zip(named, layout.specs):
        if (name != spec.name or t.dtype != WIRE_DTYPES[spec.dtype] or tuple(t.shape) != spec.shape
                or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.data_ptr() != base + spec.offset):
            return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (layout.nbytes,))


def unpack(buf: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """Views into `buf` (uint8 [layout.nbytes]) with each tensor's dtype and shape. Zero copy."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != layout.nbytes:
        raise ValueError(f"unpack: expected uint8 [{layout.nbytes}], got {buf.dtype} "
                         f"{tuple(buf.shape)}")
    out = []
    for s in layout.specs:
        raw = buf[s.offset: s.offset + s.nbytes]
        out.append((s.name, raw.view(WIRE_DTYPES[s.dtype]).reshape(s.shape)))
    return out


def _owner(name: str) -> str:
    """The weight a chunk belongs to: `x`, `x_scale`, `x_scale_inv` and the delta parts of any
    of them (`x#dpos`, `x_scale#dval`, delta.py) all belong to `x`."""
    name = name.split("#d", 1)[0]
    for suffix in ("_scale_inv", "_scale"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def group_pairs(chunks: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group each tensor with the scale(s) that directly follow it (`<name>_scale`,
    `<name>_scale_inv`), and the parts of a delta with each other, so quantized codes and their
    scales (whole or as deltas) stay in one bucket."""
    group: list[tuple[str, torch.Tensor]] = []
    for name, t in chunks:
        if group and (name in (group[0][0] + "_scale", group[0][0] + "_scale_inv")
                      or ("#d" in name + group[0][0] and _owner(name) == _owner(group[0][0]))):
            group.append((name, t))
            continue
        if group:
            yield group
        group = [(name, t)]
    if group:
        yield group


@dataclass
class Bucket:
    tensors: list[tuple[str, torch.Tensor]]  # in wire (aligned) order
    layout: BucketLayout
    last: bool  # no bucket follows (receivers commit the version after it)


def plan_buckets(chunks: Iterable[tuple[str, torch.Tensor]], budget_bytes: int) -> Iterator[Bucket]:
    """Lazily cut a stream of named tensors into buckets of at most `budget_bytes` (a single group
    larger than the budget becomes its own bucket). Tensor order inside a bucket is `align_order`.

    A bucket is cut when the next group does not fit, so `last` is known while looking ahead by
    one group only: the sender can announce a bucket before the next one is produced."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for group in group_pairs(chunks):
        gbytes = sum(t.numel() * t.element_size() for _, t in group)
        if current and size + gbytes > budget_bytes:
            ordered = align_order(current)
            yield Bucket(ordered, layout_of(ordered), last=False)
            current, size = [], 0
        current.extend(group)
        size += gbytes
    if current:
        ordered = align_order(current)
        yield Bucket(ordered, layout_of(ordered), last=True)


def timed_items(named: Iterable[tuple[str, torch.Tensor]], timing: list[float]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """`named`, adding the time spent waiting for each item to timing[0]."""
    it = iter(named)
    while True:
        t0 = time.perf_counter()
        item = next(it, None)
        timing[0] += time.perf_counter() - t0
        if item is None:
            return
        yield item
