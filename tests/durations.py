"""Write tests/durations.json from a pytest run's `--durations=0` report: the seconds each test
file took (setup + call + teardown of its tests), which tests/conftest.py uses to hand the
longest files to the xdist workers first.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
        -m "not real_model and not sglang" tests --durations=0 | .venv/bin/python tests/durations.py

Why: `--dist loadfile` gives each worker whole files, in the order they are queued; a long file
queued last runs alone on one worker while the other has finished (on 2 cores, minutes of the
suite's wall time). Longest first, the workers finish within about one short file of each other.
Only the order depends on these numbers: a stale or missing entry makes the suite no less correct.
"""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s\s+(?:setup|call|teardown)\s+(tests/[^:\s]+\.py)")


def file_seconds(report: str) -> dict[str, float]:
    """{test file name: seconds} summed over the report's lines, longest first."""
    secs: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        m = LINE.match(line)
        if m:
            secs[Path(m.group(2)).name] += float(m.group(1))
    return {k: round(v, 1) for k, v in sorted(secs.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    out = Path(__file__).with_name("durations.json")
    secs = file_seconds(sys.stdin.read())
    if not secs:
        sys.exit("no `--durations` lines on stdin (run pytest with --durations=0)")
    out.write_text(json.dumps(secs, indent=0) + "\n")
    print(f"{out}: {len(secs)} files, {sum(secs.values()):.0f} s in all")
