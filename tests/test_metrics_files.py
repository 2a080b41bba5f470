"""metrics.jsonl and trained.jsonl after a kill mid-write: a torn last line is dropped with one
warning and the resume goes on; a bad line elsewhere is an error naming file and line. And the
comparison of two runs' records, step for step."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from qurl.errors import InputError
from qurl.pipeline.records import TrainedLog
from qurl.train.metrics_log import MetricsLogger, metric_differences, read_metrics

RECORDS = [{"kind": "train", "step": s, "reward": 0.5 * s} for s in (1, 2, 3)]


def _torn(path, records=RECORDS) -> str:
    """The file a kill leaves: whole records, then the first half of the next one."""
    whole = "".join(json.dumps(r) + "\n" for r in records)
    nxt = json.dumps({"kind": "train", "step": len(records) + 1, "reward": 9.0})
    path.write_text(whole + nxt[: len(nxt) // 2])
    return whole


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "half-written" in r.getMessage()]


def test_resume_after_a_torn_metrics_line_warns_once(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    _torn(path)
    with caplog.at_level(logging.WARNING, logger="qurl.train.metrics_log"):
        logger = MetricsLogger(tmp_path, total_steps=5, start_step=2, progress=False)
        logger.log({"kind": "train", "step": 3, "reward": 1.0})
        logger.close()
        again = MetricsLogger(tmp_path, total_steps=5, start_step=3, progress=False)
        again.close()
    warned = _warnings(caplog)
    assert len(warned) == 1 and f"{path}:4" in warned[0]  # the torn line, once
    assert [(r["step"], r["reward"]) for r in read_metrics(path)] == [(1, 0.5), (2, 1.0), (3, 1.0)]


def test_resume_after_a_torn_trained_line(tmp_path, caplog):
    path = tmp_path / "trained.jsonl"
    recs = [{"step": s, "uids": [s], "keys": [f"{s}@0"], "dispatch_versions": [s - 1]}
            for s in (1, 2)]
    whole = _torn(path, recs)
    with caplog.at_level(logging.WARNING, logger="qurl.train.metrics_log"):
        log = TrainedLog(path, start_step=2)
        log.write(3, [SimpleNamespace(uid=7, key="7@3", version=2)])
        log.close()
    assert len(_warnings(caplog)) == 1
    assert path.read_text() == whole + json.dumps(
        {"step": 3, "uids": [7], "keys": ["7@3"], "dispatch_versions": [2]}) + "\n"


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n{oops\n" + json.dumps(RECORDS[1]) + "\n")
    with pytest.raises(InputError, match=rf"{path}:2: not a JSON record"):
        read_metrics(path)


def test_metric_differences_compares_every_non_timing_key():
    a = [{"kind": "train", "step": 1, "reward": 0.5, "kl": float("nan"), "time/train": 3.0,
          "sync/bytes": 10},
         {"kind": "eval", "step": 1, "acc": 0.25}]
    b = [{"kind": "train", "step": 1, "reward": 0.5, "kl": None, "time/train": 9.0,
          "sync/bytes": 99}]
    # NaN in memory equals the null it is written as; timing differs between equal runs
    assert metric_differences(a[:1], b, skip_prefixes=("sync/",)) == []
    assert metric_differences(a[:1], b) == ["('train', 1): sync/bytes 10 != 99"]
    assert metric_differences(a, b, skip_prefixes=("sync/",)) == [
        "('eval', 1): only in the first run"]
    c = [dict(b[0], reward=0.5000001, extra=1)]
    assert metric_differences(b, c) == ["('train', 1): extra '<absent>' != 1",
                                        "('train', 1): reward 0.5 != 0.5000001"]
