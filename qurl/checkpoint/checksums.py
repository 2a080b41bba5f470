"""Checksums of checkpoint files, so a resume can tell an intact checkpoint from a damaged one.

A checkpoint directory holds `manifest.json`:

    {"format": 1, "files": {"model_rank0.pt": {"bytes": 123, "blake3": "<hex>"}, ...}}

listing every other file of the checkpoint. Files are hashed (BLAKE3) as they are written:
`save_torch` hashes the bytes on their way to disk, so a large shard is never read back at save
time; `write_manifest` hashes after the fact only a file nobody reported. The manifest is written
inside the temp dir before the atomic rename (rundir.py), so a committed checkpoint always has
the checksums of the bytes its writers produced.

`damage(dir)` re-reads a checkpoint and names the first problem: a missing file, a size that
differs (truncation: checked for every file before any hashing), a checksum that differs (flipped
bytes), or an unreadable manifest. A checkpoint without a manifest was written before qurl
recorded checksums; `damage` cannot vouch for it and `has_manifest` lets the caller say so.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, TypedDict

from blake3 import blake3

MANIFEST = "manifest.json"
FORMAT = 1


class FileSum(TypedDict):
    bytes: int
    blake3: str


class _HashingWriter:
    """A binary file that hashes and counts what is written through it (what torch.save needs)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.hasher, self.n = f, blake3(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        self.n += view.nbytes
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()

    def sum(self) -> FileSum:
        return {"bytes": self.n, "blake3": self.hasher.hexdigest()}


def save_torch(obj: Any, path: str | Path) -> FileSum:
    """torch.save(obj) to `path` (via `path.tmp` + rename) and return the written bytes' checksum."""
    import torch

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
    os.replace(tmp, path)
    return w.sum()


def hash_file(path: str | Path) -> FileSum:
    """Checksum of a file on disk (memory-mapped, hashed on all cores)."""
    path = Path(path)
    size = path.stat().st_size
    h = blake3(max_threads=blake3.AUTO)
    if size:
        h.update_mmap(path)
    return {"bytes": size, "blake3": h.hexdigest()}


def write_manifest(directory: str | Path, sums: dict[str, FileSum]) -> dict[str, FileSum]:
    """Write `directory/manifest.json` listing every file in `directory` (sub-directories are not
    expected in a checkpoint and are refused). `sums` holds the checksums taken while writing;
    files missing from it are hashed now. Returns the full listing."""
    d = Path(directory)
    files: dict[str, FileSum] = {}
    for p in sorted(d.iterdir()):
        if p.name == MANIFEST:
            continue
        if not p.is_file():
            raise ValueError(f"{p}: a checkpoint holds plain files only")
        files[p.name] = sums[p.name] if p.name in sums else hash_file(p)
    unknown = sorted(set(sums) - set(files))
    if unknown:
        raise FileNotFoundError(f"{d}: reported as written but absent: {', '.join(unknown)}")
    tmp = d / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True))
    os.replace(tmp, d / MANIFEST)
    return files


def has_manifest(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST).exists()


def read_manifest(d: Path) -> dict[str, FileSum]:
    try:
        doc = json.loads((d / MANIFEST).read_text())
        files = doc["files"]
        ok = doc.get("format") == FORMAT and isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("blake3"), str)
            for v in files.values())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{MANIFEST} is unreadable")
    return files


def damage(directory: str | Path) -> str | None:
    """None if every file the manifest lists is present with its recorded size and checksum, else
    one line naming the first damaged file. A directory without a manifest is not checked here
    (`has_manifest`)."""
    d = Path(directory)
    if not has_manifest(d):
        return None
    try:
        files = read_manifest(d)
    except ValueError as e:
        return f"{d / MANIFEST}: {e}"
    for name, want in files.items():  # sizes first: a truncated file costs no hashing
        p = d / name
        if not p.is_file():
            return f"{p}: missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{p}: {size} bytes, the manifest says {want['bytes']}"
    for name, want in files.items():
        if hash_file(d / name)["blake3"] != want["blake3"]:
            return f"{d / name}: BLAKE3 checksum differs from the manifest (bytes changed)"
    return None
