"""One 8-bit export per directory, however many processes (nodes) ask for it at the same time.

Why. `qurl launch` runs the export command (`python -m qurl.checkpoint.shared_export`, which
wraps qurl/models/export8bit.py) on every node that
starts SGLang servers, and on a shared filesystem they all name one directory. `export_8bit` alone
writes `<out>.tmp`, deletes `<out>` and renames: several nodes at once delete each other's temp
files, and the checkpoint a server on another node is already loading (issue 59, item 1).

The protocol (`export_shared`), for every caller alike:
1. Done? `<out>/export.json` names the same request (the source's files by name, size and mtime;
   fmt; UAQ scale; dtype) and `<out>/manifest.json` (BLAKE3 of every file,
   checksums.py; written last) verifies: return `<out>`, writing nothing.
2. Else take the lock `<out>.lock` (created with O_CREAT | O_EXCL: one winner, on local disks and
   NFSv3+ alike). The holder checks 1 again, exports into a staging directory of its own
   (`<out>.staging-<host>-<pid>`), adds export.json and then the manifest, removes an `<out>` that
   answers another request, renames the staging directory into place and drops the lock.
3. Everyone else polls 1 until it holds, at most `wait_s`, then raises TimeoutError naming the
   directory, why it is not ready and the lock's holder.

A holder rewrites the lock's heartbeat every BEAT_S; a lock whose content has not changed for
`stale_s` on the waiter's own clock (no clocks are compared across hosts), or whose holder is a
dead process of this host, is stale: a waiter moves it aside (checking it moved the very lock it
judged stale, else puts it back) and competes for a new one. A holder checks that it still owns
the lock before it commits. Invariant: `<out>` is absent or a complete export that verified;
it is replaced only by a lock holder exporting a different request.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from qurl.checkpoint.checksums import damage, has_manifest, write_manifest
from qurl.models.export8bit import FORMATS, export_8bit

REQUEST = "export.json"
BEAT_S = 2.0
POLL_S = 0.2


def request_of(src: str | Path, fmt: str, uaq_scale: float, dtype: torch.dtype) -> dict:
    """What an export is of: the source files (name, bytes, mtime_ns), fmt, UAQ scale, dtype."""
    src = Path(src)
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns]
             for p in sorted(src.iterdir()) if p.is_file()}
    return {"src": str(src.resolve()), "files": files, "fmt": fmt, "uaq_scale": float(uaq_scale),
            "dtype": str(dtype)}


def not_ready(out: Path, want: dict) -> str | None:
    """None when `out` is a complete export of `want` whose files verify, else why not (one line)."""
    try:
        got = json.loads((out / REQUEST).read_text())
    except FileNotFoundError:
        return "absent" if not out.exists() else f"no {REQUEST}"
    except (OSError, ValueError) as e:
        return f"{REQUEST} unreadable ({e})"
    if got != want:
        return "it holds another export (source, fmt or UAQ scale differ)"
    if not has_manifest(out):
        return "no manifest"
    try:
        return damage(out)
    except OSError as e:  # replaced while we read it
        return f"changing ({e})"


class _Lock:
    """`<out>.lock`, held by this process; a thread rewrites its heartbeat (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path, self.token = path, f"{socket.gethostname()} {os.getpid()} {time.time_ns()}"
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _text(self, n: int) -> str:
        return f"{self.token} {n}\n"

    def acquire(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(self._text(0))
        self._beat = threading.Thread(target=self._beats, daemon=True, name="export-lock")
        self._beat.start()
        return True

    def _beats(self) -> None:
        n = 0
        while not self._stop.wait(BEAT_S):
            n += 1
            if self.owned():
                try:
                    self.path.write_text(self._text(n))
                except OSError:
                    pass

    def owned(self) -> bool:
        try:
            return self.path.read_text().startswith(self.token + " ")
        except OSError:
            return False

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self.owned():
            self.path.unlink(missing_ok=True)


def _holder_dead_here(text: str) -> bool:
    """The lock names a process of this host that no longer exists."""
    parts = text.split()
    if len(parts) < 2 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _break_stale(lock: Path, seen: str) -> None:
    """Move aside the lock whose content is `seen`; if what moved is another (fresh) lock, put it
    back (os.link fails rather than overwrite a lock created meanwhile)."""
    aside = lock.with_name(f"{lock.name}.stale-{socket.gethostname()}-{os.getpid()}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return
    try:
        if aside.read_text() != seen:
            try:
                os.link(aside, lock)
            except FileExistsError:
                pass
    finally:
        aside.unlink(missing_ok=True)


def export_shared(src: str | Path, out: str | Path, fmt: str, *,
                  write: Callable[[Path], object], uaq_scale: float = 1.0,
                  dtype: torch.dtype = torch.bfloat16, wait_s: float = 3600.0,
                  stale_s: float = 120.0) -> Path:
    """Make `out` a complete, verified export of (src, fmt, uaq_scale, dtype), exporting it only if
    no other process has or is (module docstring). `write(staging)` writes the checkpoint files
    into directory `staging` (qurl/models/export8bit.py). Returns `out`; TimeoutError after
    `wait_s` without a complete export."""
    out = Path(out)
    want = request_of(src, fmt, uaq_scale, dtype)
    lock_path = out.with_name(out.name + ".lock")
    deadline = time.monotonic() + wait_s
    seen, seen_since = "", time.monotonic()
    while True:
        why = not_ready(out, want)
        if why is None:
            return out
        lock = _Lock(lock_path)
        if lock.acquire():
            try:
                if not_ready(out, want) is None:
                    return out
                return _export(out, want, lock, write)
            finally:
                lock.release()
        try:
            text = lock_path.read_text()
        except FileNotFoundError:
            continue  # released meanwhile: look again
        now = time.monotonic()
        if text != seen:
            seen, seen_since = text, now
        elif now - seen_since > stale_s or _holder_dead_here(text):
            _break_stale(lock_path, text)
            continue
        if now > deadline:
            raise TimeoutError(f"{out}: no complete export after {wait_s:.0f}s ({why}); "
                               f"{lock_path} is held by {' '.join(text.split()[:2]) or '?'}")
        time.sleep(POLL_S)


def _export(out: Path, want: dict, lock: _Lock, write: Callable[[Path], object]) -> Path:
    staging = out.with_name(f"{out.name}.staging-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
        (staging / REQUEST).write_text(json.dumps(want, indent=1, sort_keys=True))
        write_manifest(staging, {})  # last: its presence means every file is in place
        if not lock.owned():
            raise RuntimeError(f"{out}: lost the export lock {lock.path} (judged stale by "
                               "another process); this export is discarded")
        if out.exists():  # another request's export (ours returned in export_shared)
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m qurl.checkpoint.shared_export`: export_8bit's command line, once per --out."""
    p = argparse.ArgumentParser(prog="python -m qurl.checkpoint.shared_export", description=(
        "write an HF checkpoint as an SGLang 8-bit checkpoint, once per --out however many "
        "processes ask at once"))
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fmt", choices=FORMATS + ("bf16",), default="int8")
    p.add_argument("--uaq-scale", type=float, default=1.0)
    p.add_argument("--wait-s", type=float, default=3600.0,
                   help="how long to wait for another process exporting the same --out")
    args = p.parse_args(argv)
    print(export_shared(args.src, args.out, args.fmt, uaq_scale=args.uaq_scale,
                        wait_s=args.wait_s, write=lambda staging: export_8bit(
                            args.src, staging, args.fmt, uaq_scale=args.uaq_scale)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
