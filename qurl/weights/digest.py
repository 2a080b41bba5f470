"""Weight digests: how an engine proves, after every sync, that it holds the learner's exact bits.

A delta sync (qurl/weights/delta.py) is only correct if it lands on exactly the version it was
computed against, and any sync can go wrong in ways no exception reports (a buggy apply, memory
corrupted on the engine, a receiver that skipped a bucket). So after each sync both ends hash the
tensors, never the wire: the sender hashes the engine chunks of version v it quantized (codes,
scales, pass-throughs in their wire dtype), the engine hashes what it actually holds under the
same names, and they compare. Nothing is read back over the network: 8 bytes per tensor travel
in the last bucket's announcement (or are compared in process).

    tensor_digest(t)     BLAKE3 of t's raw bytes (C order, native little-endian), 8 bytes as hex;
                         dtype and shape are hashed too, so a reinterpretation never matches
    named_digests(named) {name: digest}
    combine(digests)     one digest of a whole version (names sorted), what a delta's base names

A mismatch names the tensors that differ; the caller resyncs in full and counts it (never trains
on the engine's output as if it held v). Cost: one pass over the weights on each end
(BLAKE3 ~1.7 GB/s per core here), reported as `sync/time_verify`.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from blake3 import blake3

DIGEST_BYTES = 8


def tensor_digest(t: torch.Tensor) -> str:
    """Hex digest of t's dtype, shape and bytes (t on any device; copied to CPU if needed)."""
    h = blake3(f"{t.dtype}:{tuple(t.shape)}:".encode())
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel():
        h.update(memoryview(flat.view(torch.uint8).cpu().numpy()))
    return h.hexdigest(length=DIGEST_BYTES)


def named_digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {n: tensor_digest(t) for n, t in named}


def combine(digests: Mapping[str, str]) -> str:
    """One digest of a whole version: BLAKE3 over `name=digest` lines in name order."""
    h = blake3()
    for n in sorted(digests):
        h.update(f"{n}={digests[n]}\n".encode())
    return h.hexdigest(length=DIGEST_BYTES)


def mismatches(expected: Mapping[str, str], got: Mapping[str, str]) -> list[str]:
    """Names whose digests differ or that one side lacks, sorted."""
    return sorted(n for n in set(expected) | set(got) if expected.get(n) != got.get(n))
