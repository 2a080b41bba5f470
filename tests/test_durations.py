"""The suite's file order (tests/durations.py, tests/conftest.py): per-file seconds summed from a
`--durations=0` report, and the longest files queued first with each file's tests together."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from conftest import _longest_files_first
from durations import file_seconds


def test_file_seconds_sums_setup_call_and_teardown_per_file():
    report = """============ slowest durations ============
101.43s setup    tests/test_gpu_check.py::test_dry_run[x-1]
12.00s call     tests/test_a.py::test_one
0.50s teardown tests/test_a.py::test_one
3.25s call     tests/test_gpu_check.py::test_numbers
(2 durations < 0.005s hidden.)
1080 passed in 685.28s (0:11:25)"""
    assert file_seconds(report) == {"test_gpu_check.py": 104.7, "test_a.py": 12.5}
    assert list(file_seconds(report)) == ["test_gpu_check.py", "test_a.py"]  # longest first
    assert file_seconds("1080 passed in 685.28s") == {}


def test_the_listed_files_come_first_longest_first_and_a_files_tests_stay_in_order(tmp_path):
    secs = json.loads(Path(__file__).with_name("durations.json").read_text())
    assert all(Path(__file__).with_name(n).exists() for n in secs)  # it names real files
    names = ["test_unlisted_b.py", "test_two_nodes.py", "test_unlisted_a.py", "test_kill.py",
             "test_unlisted_b.py", "test_kill.py", "test_two_nodes.py"]
    items = [SimpleNamespace(path=tmp_path / n, i=i) for i, n in enumerate(names)]
    _longest_files_first(items)
    longer, shorter = sorted(["test_two_nodes.py", "test_kill.py"], key=lambda n: -secs[n])
    assert [(it.path.name, it.i) for it in items] == [
        *[(n, i) for i, n in enumerate(names) if n == longer],
        *[(n, i) for i, n in enumerate(names) if n == shorter],
        ("test_unlisted_b.py", 0), ("test_unlisted_b.py", 4), ("test_unlisted_a.py", 2)]
