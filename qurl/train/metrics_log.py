"""Where per-step numbers go: `metrics.jsonl` (always), wandb (when enabled), the progress display
(progress.py: a bar in a terminal, a line per step in a log).

Each record is one JSON object with `step` and `kind` ("train" | "eval"). Values must be finite or
explicitly `null`: a NaN is written as null *and* counted in `nan_fields`, never silently as 0.
On resume the file is truncated to the records at or before the checkpoint's step, so a resumed run's
metrics.jsonl equals an uninterrupted one's.

A run killed in the middle of a write leaves a half-written last line (a torn record). Reading
drops it with one warning naming the file, and the resume's truncation rewrites the file without
it, so the warning comes once; an unreadable line anywhere else is damage, not a kill, and is an
error naming file and line.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from qurl.errors import InputError
from qurl.train.progress import Progress

log = logging.getLogger("qurl.train.metrics_log")


def _clean(record: dict[str, Any]) -> dict[str, Any]:
    out, nans = {}, []
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            nans.append(k)
            v = None
        out[k] = v
    if nans:
        out["nan_fields"] = nans
    return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The JSON records of a .jsonl file, one per non-empty line ([] when the file is absent). A
    torn last line (a kill mid-write) is dropped with a warning; any other bad line raises
    InputError naming file and line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    out = []
    for k, (i, line) in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if k == len(lines) - 1:
                log.warning("qurl: %s:%d: dropped a half-written last record (the run was stopped "
                            "while writing it)", path, i)
                break
            raise InputError(f"{path}:{i}: not a JSON record ({e.msg})") from None
    return out


TIMING_KEYS = ("time", "tokens_per_s", "wall", "threads/")
"""Substrings of the keys that measure the machine, not the run: they differ between equal runs."""


def metric_differences(a: list[dict[str, Any]], b: list[dict[str, Any]], *,
                       skip_prefixes: tuple[str, ...] = ()) -> list[str]:
    """Where two runs' records differ, one line each ([] = equal, step for step): a record only
    one run has, a key only one record has, or a value that differs (exactly: NaN/null equals
    NaN/null). Keys holding a timing substring (TIMING_KEYS) or starting with one of
    skip_prefixes are not compared."""
    def key(r: dict[str, Any]) -> tuple:
        return r.get("kind"), r.get("step")

    def kept(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if not k.startswith(skip_prefixes)
                and not any(t in k for t in TIMING_KEYS)}

    def missing(v: Any) -> bool:  # NaN in memory, null once written
        return v is None or (isinstance(v, float) and v != v)

    ra, rb = ({key(r): kept(r) for r in rs} for rs in (a, b))
    out = [f"{k}: only in the {side} run" for side, x, y in (("first", ra, rb), ("second", rb, ra))
           for k in x if k not in y]
    for k in ra.keys() & rb.keys():
        x, y = ra[k], rb[k]
        for name in x.keys() | y.keys():
            u, v = x.get(name, "<absent>"), y.get(name, "<absent>")
            if u != v and not (missing(u) and missing(v)):
                out.append(f"{k}: {name} {u!r} != {v!r}")
    return sorted(out)


class MetricsLogger:
    def __init__(self, run_dir: Path, *, total_steps: int, start_step: int = 0, wandb: str = "off",
                 run_name: str = "", config: dict | None = None,
                 progress: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")
        self._wandb = None
        if wandb != "off":  # deploy.wandb: offline | online
            import wandb as wb  # optional: only imported when asked for

            self._wandb = wb.init(project="qurl", name=run_name, mode=wandb, config=config,
                                  dir=str(run_dir), resume="allow")
        self._progress = Progress(total_steps, start_step) if progress else None

    def log(self, record: dict[str, Any]) -> None:
        rec = _clean(record)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({f"{rec['kind']}/{k}": v for k, v in rec.items()
                             if isinstance(v, (int, float)) and v is not None}, step=rec["step"])
        if self._progress is not None and rec["kind"] == "train":
            self._progress.step(rec)

    def write(self, text: str) -> None:
        """Print a status line on a line of its own, never onto the progress display."""
        if self._progress is not None:
            self._progress.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._progress is not None:
            self._progress.close()
        if self._wandb is not None:
            self._wandb.finish()
