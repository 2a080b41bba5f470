"""A study's committed records, loose or packed into one archive beside the study's pages.

Layout. A study's output directory `<out>` (docs/study/<study>/, the `--out` of `qurl study
ablation`) keeps as files only what a reader opens: its pages (*.md), the figures they embed
(*.png) and scripts (*.py). Everything else is a record — each arm's config.toml, metrics.jsonl,
final_eval.json and base.json (qurl/research/studies/store.py), the tables' CSVs, other evaluation records
(*.json) — and a finished study keeps its records in one xz-compressed tar beside `<out>`:

    <out>.tar.xz        e.g. docs/study/smollm2_sft.tar.xz, members named relative to <out>:
                        "int8-tis/seed1/metrics.jsonl", "ablation.csv", ...

so that a clone's docs/ holds pages, not megabytes of metrics. List it with `tar -tJf <out>.tar.xz`,
print one member with `tar -xJOf <out>.tar.xz ablation.csv`, extract it all with `qurl study unpack
--out <out>` (or `tar -xJf <out>.tar.xz -C <out>`).

Reading (`open_records`). Every reader of committed records goes through `open_records(path)`,
where path is a study's `<out>`, a directory inside it (an arm's `<out>/<arm>/seed<S>`), or any run
directory. The view it returns merges the loose files under path with the members of the nearest
archive that holds it (`<a>.tar.xz` for path or one of its first MAX_DEPTH ancestors `<a>`); a loose
file wins over a member of the same name. So `qurl study ablation --table-only --out <out>` and
`python -m qurl.research.studies.misses <out>/<arm>/seed<S> ...` read a packed study as they read a loose
one, and an arm that a running study commits loose (store.commit) sits beside the packed ones
until the study is packed again. Members are read straight from the archive (decompressed once per
archive version and kept in memory: a study's records are a few MB); a reader that needs a real
file (a config parser, qurl.train.metrics_log) gets the members copied to a temporary directory
(`Records.on_disk`).

Writing. New arms and final evaluations are committed loose. Tables that a packed study rebuilds
(`write_records`: the ablation CSVs) are written into its archive, so `--table-only` on a packed
study leaves no loose records behind, and rebuilds the archive byte for byte when the tables come
out the same. `pack(out)` (`qurl study pack --out <out>`) folds the loose records under `<out>` into
its archive and removes them; `unpack(out)` is its inverse.

Deterministic archives: members sorted by name, regular files only (no directory entries), mtime
0, uid/gid 0, no owner names, mode 0644, POSIX tar, then xz at preset 9e. The same records always
pack to the same bytes, so a rebuilt archive shows in git only when a record changed.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import lzma
import os
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath

SUFFIX = ".tar.xz"
PAGES = (".md", ".png", ".py")  # what stays a file beside the archive: pages, figures, scripts
MAX_DEPTH = 3  # how many ancestors of a path are searched for the archive holding it
_PRESET = 9 | lzma.PRESET_EXTREME


def archive_path(out: Path) -> Path:
    """Where the records of the study in directory `out` are packed: `<out>.tar.xz` beside it."""
    out = Path(out)
    return out.with_name(out.name + SUFFIX)


def is_record(name: str) -> bool:
    """Whether a file belongs in the archive (a record), not beside it (a page, figure or script);
    editor and writer temporaries (names starting with '.') are neither."""
    path = PurePosixPath(name)
    return path.suffix not in PAGES and not path.name.startswith(".")


@functools.lru_cache(maxsize=4)
def _members(archive: str, mtime_ns: int, size: int) -> dict[str, bytes]:
    """{name: bytes} of an archive's regular files; cached per (path, mtime, size) version."""
    del mtime_ns, size  # the cache key only
    out = {}
    with tarfile.open(archive, "r:xz") as tar:
        for info in tar:
            f = tar.extractfile(info) if info.isfile() else None
            if f is not None:
                out[info.name.removeprefix("./")] = f.read()
    return out


def read_archive(archive: Path) -> dict[str, bytes]:
    """{member name: bytes} of an archive ({} when it does not exist)."""
    try:
        st = Path(archive).stat()
    except FileNotFoundError:
        return {}
    return _members(str(Path(archive).resolve()), st.st_mtime_ns, st.st_size)


class Records:
    """The records under one directory: its loose files, and the members of the archive holding
    it under `prefix` (module docstring). Names are relative to `root`, '/'-separated."""

    def __init__(self, root: Path, archive: Path | None = None, prefix: str = "") -> None:
        self.root, self.archive, self.prefix = Path(root), archive, prefix

    def _packed(self) -> dict[str, bytes]:
        if self.archive is None:
            return {}
        members = read_archive(self.archive)
        if not self.prefix:
            return members
        head = self.prefix.rstrip("/") + "/"
        return {n[len(head):]: b for n, b in members.items() if n.startswith(head)}

    def names(self) -> list[str]:
        """Every record and loose file's name under root, sorted."""
        loose = ({p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()}
                 if self.root.is_dir() else set())
        return sorted(loose | set(self._packed()))

    def exists(self, name: str) -> bool:
        return (self.root / name).is_file() or name in self._packed()

    def read_bytes(self, name: str) -> bytes:
        """A file's bytes, loose first; FileNotFoundError naming both places when neither has it."""
        path = self.root / name
        if path.is_file():
            return path.read_bytes()
        packed = self._packed()
        if name in packed:
            return packed[name]
        where = f" nor in {self.archive}" if self.archive else ""
        raise FileNotFoundError(f"{path}: no such record{where}")

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode()

    @contextlib.contextmanager
    def on_disk(self, *names: str) -> Iterator[Path]:
        """A directory holding `names` as files: root itself when they are all loose there (or one
        is nowhere: the caller's reader then reports it missing from root, as for a run directory),
        else a temporary copy of them, loose and packed, removed on exit."""
        if all((self.root / n).is_file() for n in names) or not all(map(self.exists, names)):
            yield self.root
            return
        with tempfile.TemporaryDirectory(prefix="qurl-records-") as tmp:
            for n in names:
                dest = Path(tmp) / n
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(self.read_bytes(n))
            yield Path(tmp)


def open_records(path: str | Path) -> Records:
    """The records under `path` (a study's `<out>`, an arm directory inside it, a run directory):
    its loose files and the archive of the nearest of path and its first MAX_DEPTH ancestors that
    has one (module docstring). The one way every study reader opens committed records."""
    path = Path(path)
    top = path
    for _ in range(MAX_DEPTH + 1):
        if top.name:
            archive = archive_path(top)
            if archive.is_file():
                rel = path.relative_to(top).as_posix()
                return Records(path, archive, "" if rel == "." else rel)
        if top.parent == top:
            break
        top = top.parent
    return Records(path)


def write_archive(archive: Path, members: Mapping[str, bytes]) -> Path:
    """Write `members` ({name: bytes}) deterministically (module docstring), replacing archive."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(members):
            data = members[name]
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    blob = lzma.compress(buf.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                         preset=_PRESET)
    archive = Path(archive)
    if archive.is_file() and archive.read_bytes() == blob:
        return archive  # unchanged: leave the file (and its mtime) alone
    tmp = archive.with_name(f".{archive.name}.tmp")
    tmp.write_bytes(blob)
    tmp.replace(archive)
    return archive


def write_records(out: str | Path, files: Mapping[str, str]) -> list[Path]:
    """Write records ({name: text}) of the study in `out`: into its archive when the study is
    packed (one rewrite for all of them; a loose file of the same name is replaced instead, as
    it would win on reading), else as loose files. Returns the files written (the archive once)."""
    out = Path(out)
    archive = archive_path(out)
    into_archive = {n: t for n, t in files.items() if archive.is_file() and not (out / n).exists()}
    written = []
    for name, text in files.items():
        if name not in into_archive:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            with (out / name).open("w", newline="") as f:  # as given: no newline translation
                f.write(text)
            written.append(out / name)
    if into_archive:
        members = dict(read_archive(archive))
        members.update({n: t.encode() for n, t in into_archive.items()})
        written.append(write_archive(archive, members))
    return written


def loose_records(out: Path) -> list[Path]:
    """The loose record files under out (is_record), sorted."""
    out = Path(out)
    return sorted(p for p in out.rglob("*") if p.is_file()
                  and is_record(p.relative_to(out).as_posix())) if out.is_dir() else []


def pack(out: str | Path) -> Path:
    """Fold the loose records under `out` into `<out>.tar.xz` (loose replacing members of the same
    name), delete them and the directories they leave empty (out too, when nothing is left).
    Returns the archive; ValueError when there is nothing to pack."""
    out = Path(out)
    archive = archive_path(out)
    loose = loose_records(out)
    members = dict(read_archive(archive))
    if not loose and not members:
        raise ValueError(f"{out}: no records to pack (loose or in {archive})")
    members.update({p.relative_to(out).as_posix(): p.read_bytes() for p in loose})
    write_archive(archive, members)
    for p in loose:
        p.unlink()
    for d in sorted({q for p in loose for q in p.parents if q == out or out in q.parents},
                    key=lambda q: len(q.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()  # only when empty
    return archive


def unpack(out: str | Path) -> list[Path]:
    """Extract `<out>.tar.xz` into `out` as loose files (replacing loose ones of the same name);
    the archive stays. Returns the files written."""
    out = Path(out)
    archive = archive_path(out)
    members = read_archive(archive)
    if not members:
        raise FileNotFoundError(f"{archive}: no archive of {out}'s records")
    written = []
    for name, data in sorted(members.items()):
        dest = out / name
        if out.resolve() not in dest.resolve().parents:
            raise ValueError(f"{archive}: member {name!r} lies outside {out}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        written.append(dest)
    return written


def main_records(argv: list[str] | None = None) -> int:
    """`python -m qurl.research.studies.records pack|unpack|list OUT...` (`qurl study pack|unpack --out`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("pack", "unpack", "list"))
    ap.add_argument("out", nargs="+", type=Path, help="study directories (<out>, not <out>.tar.xz)")
    args = ap.parse_args(argv)
    for out in args.out:
        if args.what == "pack":
            archive = pack(out)
            print(f"{archive}: {len(read_archive(archive))} records, {os.path.getsize(archive)} "
                  "bytes")
        elif args.what == "unpack":
            print(f"{out}: {len(unpack(out))} records extracted from {archive_path(out)}")
        else:
            rec = open_records(out)
            print("\n".join(n for n in rec.names() if is_record(n)))
    return 0


if __name__ == "__main__":
    sys.exit(main_records())
