"""What the async loop writes per step besides the shared train record (qurl/train/loop.py): weight-sync
acks of the workers, and `trained.jsonl` (the prompts each step trained on).

`trained.jsonl` has one line per step: {"step", "uids" (dataset prompt uids, in batch order),
"keys" (dispatch keys `uid@did`), "dispatch_versions"}. Like metrics.jsonl it is truncated to the
checkpoint's step on resume (a torn last line, from a kill mid-write, is dropped with a warning:
qurl/train/metrics_log.py), so over a resumed run it lists every trained prompt exactly as often as it was
trained — the record exactly-once is checked against.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from qurl.train.metrics_log import read_metrics


def ack_stats(acks: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Slowest worker's load and pause time among the `synced` acks received, how many there were
    (`sync/worker_acks`) and how many of them applied a delta (`sync/worker_delta_acks`), and
    their verification: `sync/verified` 1 when every ack says its engine matched the learner's
    digests, 0 when one did not (it then asked for a full resync), NaN when no ack came."""
    acks = list(acks)
    out = {"sync/worker_acks": float(len(acks)),
           "sync/worker_delta_acks": float(sum(1 for a in acks if a.get("mode") == "delta"))}
    for k in ("load_s", "pause_s"):
        vals = [a[k] for a in acks if isinstance(a.get(k), (int, float))]
        if vals:
            out[f"sync/worker_{k[:-2]}_max"] = float(max(vals))
    # every worker checks each sync against the learner's digests (worker.py)
    checks = [a["verified"] for a in acks if isinstance(a.get("verified"), (int, float))]
    out["sync/verified"] = float(min(checks)) if checks else float("nan")
    out["sync/verify_mismatches"] = float(sum(1 for c in checks if c == 0))
    return out


class TrainedLog:
    """Append-only `trained.jsonl`, truncated to records at or before `start_step` when opened."""

    def __init__(self, path: Path, start_step: int) -> None:
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= start_step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
        self._file = path.open("a")

    def write(self, step: int, dispatches: list[Any]) -> None:
        self._file.write(json.dumps({
            "step": step, "uids": [d.uid for d in dispatches], "keys": [d.key for d in dispatches],
            "dispatch_versions": [d.version for d in dispatches]}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
