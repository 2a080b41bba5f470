"""Delta encoding of one weight version against the previous one: send only what changed.

After an RL step only a small share of the 8-bit codes flips (qurl.quant.flips: 0.2-5%), the
fp32 scales of most rows move a little, and the bf16 pass-throughs (embeddings, norms) hardly
change at all (an update of ~1e-6 is far below bf16's rounding step). So for version v, per
engine chunk (codes, scales, pass-throughs, in the dtype they travel in), the sender compares the
bits with version v-1's and sends whichever is smaller:

    unchanged        nothing
    delta            name#dpos  int16 [k]       low 16 bits of each changed flat position
                     name#dend  int32 [nblk]    cumulative count of changes per block of 2^16
                                                positions (nblk = ceil(numel / 2^16))
                     name#dval  dtype [k]       the new values at those positions
    full             name       the whole tensor, as a full sync sends it

A delta costs k * (2 + itemsize) + 4 * nblk bytes: 3 bytes per flipped int8/fp8 code (plus
0.006% for the block ends), against 1 byte per code for the whole tensor, so a code tensor goes
as a delta below ~33% flipped. Positions are stored per 64Ki block (the high bits are implied by
the block) to halve the index bytes of plain int32 positions: at 2% flipped codes that is 6% of
the full bytes instead of 10%.

Bits are compared, never values: fp8 +0 and -0 differ, and a NaN can never hide a change.
On CPU the compare reads 8-byte words and looks at single elements only inside the words that
differ (`_changed_words`; at 2% flipped int8 codes ~15% of the words), and the encode gathers
with numpy (single-threaded streaming passes): the same positions and values as the plain
element-wise compare (`changed_positions_bytewise`, the tests' cross-check), in about a third of
its time for a whole model (`qurl bench sync --delta --encode-only` prints both side by side).

Applying: positions are rebuilt (block * 2^16 + low bits), must be strictly increasing and inside
the tensor, and the values must have the target's dtype; only then are they written (one
`index_put_` per tensor). `apply_named` is the reference receiver (copies; tests and the bench
use it); the local engine stages and applies the same chunks in place (qurl/engines/local_weights.py).

Invariant: apply_named(prev, encode_named(prev, new)) == new bit for bit, for every name of new.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

BLOCK_BITS = 16
BLOCK = 1 << BLOCK_BITS
SEP = "#d"
POS, END, VAL = SEP + "pos", SEP + "end", SEP + "val"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Chunks = list[tuple[str, torch.Tensor]]


def is_delta_name(name: str) -> bool:
    """True for the three chunks of a delta (`<name>#dpos`, `#dend`, `#dval`)."""
    return name.endswith((POS, END, VAL))


def delta_owner(name: str) -> str:
    """The tensor a delta chunk belongs to (`x#dpos` -> `x`); other names unchanged."""
    return name[: -len(POS)] if is_delta_name(name) else name


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Flat integer view of t's bits (same width), for bitwise comparison."""
    as_int = _INT_OF_SIZE.get(t.element_size())
    if as_int is None or t.is_complex():
        raise ValueError(f"cannot compare {t.dtype} tensors bitwise")
    return t.contiguous().reshape(-1).view(as_int)


def changed_positions(prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions (int64 [k], ascending) where the bits of `new` differ from `prev`'s.
    prev, new: same shape and dtype. On CPU word by word (`_changed_words`); on a GPU, and for
    tensors under SMALL elements (where the slices' fixed cost outweighs the saving), the plain
    reference `changed_positions_bytewise`, which gives the same result."""
    a, b = _checked_bits(prev, new)
    if a.device.type != "cpu" or a.numel() < SMALL:
        return changed_positions_bytewise(prev, new)
    return torch.from_numpy(_changed_words(a.numpy(), b.numpy()))


def changed_positions_bytewise(prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The reference for `changed_positions`: one element-wise compare of the whole tensor and
    one nonzero over its numel booleans (what the CPU path did before the word-wise scan; kept
    for the tests' cross-check and the benchmark's `old` arm)."""
    a, b = _checked_bits(prev, new)
    if a.device.type == "cpu":  # numpy's compare + flatnonzero: ~2x torch's on CPU here
        return torch.from_numpy(np.flatnonzero(np.not_equal(a.numpy(), b.numpy())))
    return (a != b).nonzero().reshape(-1)


def _checked_bits(prev: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if prev.shape != new.shape or prev.dtype != new.dtype:
        raise ValueError(f"shape/dtype changed: {prev.dtype} {tuple(prev.shape)} -> "
                         f"{new.dtype} {tuple(new.shape)}")
    return _bits(prev), _bits(new)


SPAN_WORDS = 1 << 16  # words per slice of `_changed_words`: 512 KiB of each side, in L2
SMALL = 1 << 14  # elements: smaller tensors (norms, biases, scales) are compared element-wise


def _changed_words(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Ascending int64 positions where the 1-D integer arrays a and b (same dtype) differ.

    Why not `flatnonzero(a != b)`: that writes one boolean per element and then scans all of
    them, and the scan (a branch per element, mispredicted at a few % changed) costs as much
    as the compare's pass over memory (3x it on data in cache). Here the bulk is read as 8-byte
    words (8 int8 codes, 4 bf16 values at a time), aligned, in cache-sized slices: XOR the two
    slices into a reused buffer, find the words that differ (1/8 of the booleans for int8), and
    only inside those look at the elements (the XOR's nonzero lanes). An element changes iff
    its bits differ, so the positions are exactly the element-wise compare's. Elements before
    the first aligned word and after the last are compared one by one."""
    item = a.itemsize
    per = 8 // item  # elements per word (1, 2, 4, 8)
    shift = per.bit_length() - 1
    lead = (-a.ctypes.data % 8) // item if a.ctypes.data % 8 == b.ctypes.data % 8 else a.size
    lead = min(lead, a.size)
    n_words = (a.size - lead) // per
    stop = lead + n_words * per
    parts = [np.flatnonzero(a[:lead] != b[:lead])]
    if n_words:
        aw, bw = a[lead:stop].view(np.int64), b[lead:stop].view(np.int64)
        xor = np.empty(min(n_words, SPAN_WORDS), dtype=np.int64)
        for s in range(0, n_words, SPAN_WORDS):
            e = min(s + SPAN_WORDS, n_words)
            x = np.bitwise_xor(aw[s:e], bw[s:e], out=xor[: e - s])
            words = np.flatnonzero(x != 0)
            if words.size == 0:
                continue
            lanes = np.flatnonzero(x[words].view(a.dtype) != 0)  # element index in words
            first = words  # -> flat position of each changed word's first element
            first += s
            first <<= shift
            first += lead
            within = lanes & (per - 1)  # element inside its word
            lanes >>= shift  # -> which changed word
            pos = first[lanes]
            pos += within
            parts.append(pos)
    parts.append(np.flatnonzero(a[stop:] != b[stop:]) + stop)
    return np.concatenate(parts).astype(np.int64, copy=False)


def n_blocks(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


def delta_nbytes(k: int, numel: int, itemsize: int) -> int:
    """Wire bytes of a delta with k changed positions in a tensor of `numel` elements."""
    return k * (2 + itemsize) + 4 * n_blocks(numel)


def encode_positions(pos: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending flat positions int64 [k] -> (low 16 bits as int16 [k], cumulative per-block
    counts int32 [ceil(numel / 2^16)])."""
    pos = pos.to(torch.int64).contiguous()
    bounds = torch.arange(1, n_blocks(numel) + 1, dtype=torch.int64) << BLOCK_BITS
    ends = torch.searchsorted(pos, bounds).to(torch.int32)
    if pos.device.type == "cpu":  # numpy's integer cast keeps the low 16 bits (mod 2^16); one
        return torch.from_numpy(pos.numpy().astype(np.int16)), ends  # thread, 2x torch's here
    low = torch.empty(pos.numel(), dtype=torch.int16, device=pos.device)
    low.copy_(pos.view(torch.int16)[::4])  # the low 16 bits (little-endian int64)
    return low, ends


def decode_positions(low: torch.Tensor, ends: torch.Tensor, numel: int, name: str = "tensor"
                     ) -> torch.Tensor:
    """Inverse of `encode_positions`, validated: int64 [k] strictly ascending, all < numel.
    ValueError naming `name` for anything else."""
    nblk = n_blocks(numel)
    if low.dtype != torch.int16 or low.dim() != 1:
        raise ValueError(f"{name}{POS}: expected int16 [k], got {low.dtype} {tuple(low.shape)}")
    if ends.dtype != torch.int32 or tuple(ends.shape) != (nblk,):
        raise ValueError(f"{name}{END}: expected int32 [{nblk}], got {ends.dtype} "
                         f"{tuple(ends.shape)}")
    k = low.numel()
    counts = torch.diff(ends.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
    if nblk and (bool((counts < 0).any()) or int(ends[-1]) != k):
        raise ValueError(f"{name}{END}: block ends must be non-decreasing and end at {k}")
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    block = torch.repeat_interleave(torch.arange(nblk, dtype=torch.int64), counts)
    pos = (block << BLOCK_BITS) | (low.to(torch.int64) & (BLOCK - 1))
    if k > 1 and not bool((pos[1:] > pos[:-1]).all()):
        raise ValueError(f"{name}{POS}: positions must be strictly ascending")
    if int(pos[-1]) >= numel:
        raise ValueError(f"{name}{POS}: position {int(pos[-1])} outside {numel} elements")
    return pos


def encode_tensor(name: str, prev: torch.Tensor | None, new: torch.Tensor,
                  pos: torch.Tensor | None = None) -> Chunks:
    """The chunks that turn `prev` into `new` (module docstring): [] when the bits are equal,
    the three delta chunks when they are smaller than the tensor, else [(name, new)].
    prev None (no base): the whole tensor. pos: `changed_positions(prev, new)` if known."""
    if prev is None:
        return [(name, new)]
    if pos is None:
        pos = changed_positions(prev, new)
    pos = pos.to(torch.int64).contiguous()
    k, numel, item = pos.numel(), new.numel(), new.element_size()
    if k == 0:
        return []
    if delta_nbytes(k, numel, item) >= numel * item:
        return [(name, new)]
    low, ends = encode_positions(pos, numel)
    return [(name + POS, low), (name + END, ends), (name + VAL, _take(new, pos))]


def _take(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """t's elements at flat positions `pos` (ascending), a new tensor [k] in t's dtype, gathered
    on the bits (no fp8 kernel needed). On CPU numpy's take: a single-threaded streaming gather,
    2-3x torch's indexing here, which also degrades most when the cores are shared."""
    bits = _bits(t)
    if bits.device.type == "cpu":
        return torch.from_numpy(np.take(bits.numpy(), pos.numpy())).view(t.dtype)
    return bits[pos].view(t.dtype)


@dataclass
class DeltaStats:
    """What one encode saved: bytes on the wire vs a full sync, tensors by outcome."""
    bytes: int = 0
    full_bytes: int = 0
    same: int = 0  # tensors not sent (bits unchanged)
    delta: int = 0  # tensors sent as a delta
    full: int = 0  # tensors sent whole (delta would be larger, or no base)
    changed: int = 0  # elements whose bits changed (in delta and full-but-changed tensors)
    by_tensor: dict[str, str] = field(default_factory=dict)


def encode_named(prev: Mapping[str, torch.Tensor] | None, new: Sequence[tuple[str, torch.Tensor]],
                 positions: Mapping[str, torch.Tensor] | None = None
                 ) -> tuple[Chunks, DeltaStats]:
    """Delta chunks of a whole version (`new`, engine chunks in wire dtypes) against `prev`
    (version v-1's chunks by name; None = send everything). Keeps `new`'s order, so codes and
    their scales stay adjacent (the bucket planner keeps adjacent chunks of one tensor together).
    positions: `diff_named(prev, new)` when the caller has it (one compare pass per sync)."""
    positions = positions or {}
    out: Chunks = []
    st = DeltaStats()
    for name, t in new:
        nbytes = t.numel() * t.element_size()
        st.full_bytes += nbytes
        base = None if prev is None else prev.get(name)
        if base is not None and (base.shape != t.shape or base.dtype != t.dtype):
            base = None
        pos = positions.get(name) if base is not None else None
        if base is not None and pos is None:
            pos = changed_positions(base, t)
        chunks = encode_tensor(name, base, t, pos)
        if not chunks:
            st.same += 1
            st.by_tensor[name] = "same"
        elif len(chunks) == 1:
            st.full += 1
            st.by_tensor[name] = "full"
            if pos is not None:
                st.changed += int(pos.numel())
        else:
            st.delta += 1
            st.by_tensor[name] = "delta"
            st.changed += chunks[0][1].numel()
        st.bytes += sum(c.numel() * c.element_size() for _, c in chunks)
        out.extend(chunks)
    return out, st


def diff_named(prev: Mapping[str, torch.Tensor], new: Sequence[tuple[str, torch.Tensor]]
               ) -> dict[str, torch.Tensor]:
    """Changed positions of every tensor of `new` that `prev` holds with the same shape and
    dtype (the one compare pass of a sync: flip fractions and the delta both use it)."""
    out = {}
    for name, t in new:
        base = prev.get(name)
        if base is not None and base.shape == t.shape and base.dtype == t.dtype:
            out[name] = changed_positions(base, t)
    return out


def group_delta_chunks(chunks: Iterable[tuple[str, torch.Tensor]]
                       ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Split received chunks into whole tensors {name: t} and deltas {name: {"pos", "end",
    "val"}}; ValueError for a tensor named both ways or a delta missing a part."""
    whole: dict[str, torch.Tensor] = {}
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in chunks:
        if is_delta_name(name):
            deltas.setdefault(delta_owner(name), {})[name[-3:]] = t
        else:
            whole[name] = t
    for name, parts in deltas.items():
        if name in whole:
            raise ValueError(f"{name}: sent both whole and as a delta")
        missing = sorted({"pos", "end", "val"} - set(parts))
        if missing:
            raise ValueError(f"{name}: delta without its {SEP}{missing[0]} part")
    return whole, deltas


def check_delta(name: str, target: torch.Tensor, parts: Mapping[str, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate one delta against the tensor it applies to; returns (flat positions int64 [k],
    values [k] in target's dtype). Writes nothing."""
    pos = decode_positions(parts["pos"], parts["end"], target.numel(), name)
    val = parts["val"]
    if val.dtype != target.dtype or tuple(val.shape) != (pos.numel(),):
        raise ValueError(f"{name}{VAL}: expected {target.dtype} [{pos.numel()}], got "
                         f"{val.dtype} {tuple(val.shape)}")
    return pos, val


def apply_positions(target: torch.Tensor, pos: torch.Tensor, val: torch.Tensor) -> None:
    """Write `val` at flat positions `pos` of `target` (contiguous), in place."""
    if not target.is_contiguous():
        raise ValueError("apply_positions: target must be contiguous")
    with torch.no_grad():  # on the bits: index_put_ has no fp8 kernel
        _bits(target).index_put_((pos.to(target.device),), _bits(val.to(target.device)))


def apply_named(base: Mapping[str, torch.Tensor], chunks: Iterable[tuple[str, torch.Tensor]]
                ) -> dict[str, torch.Tensor]:
    """Reference receiver: version v-1 by name + the delta chunks of v -> version v (new tensors;
    `base` is not modified). Every delta is validated before anything is built."""
    whole, deltas = group_delta_chunks(chunks)
    checked = {}
    for name, parts in deltas.items():
        if name not in base:
            raise ValueError(f"{name}: delta for a tensor the base does not hold")
        checked[name] = check_delta(name, base[name], parts)
    out = dict(base)
    out.update(whole)
    for name, (pos, val) in checked.items():
        t = base[name].clone()
        apply_positions(t, pos, val)
        out[name] = t
    return out
