"""What a run shows while it trains: a progress bar in a terminal, one line per step in a log.

A tqdm bar redraws itself with carriage returns and never ends its line. In a terminal that is
what a bar should do, and status lines (`[eval] ...`, the alarm) go through `tqdm.write`, which
clears the bar, prints the line and redraws the bar below it. In a file or a pipe (`qurl train
> log 2>&1`, a Slurm log) the carriage returns stay in the text, so a status line printed there
would be glued to the bar's last frame. There the bar is not drawn at all: each train step
prints one plain line (`qurl: step 3/40 reward=0.25 ...`) to stderr, and status lines go to
stdout on lines of their own.

While the bar is up, records of Python's logging that would reach the terminal are written
above it too (tqdm's `logging_redirect_tqdm`), so a warning from deep in the run does not land in
the middle of the bar either.

Which mode: the bar when stderr (where it draws) is a terminal, plain lines otherwise.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, TextIO

SHOWN = ("reward", "kl_behav_prox", "flip_frac")
"""The train record's fields shown beside the step (bar postfix, or the plain line)."""


class Progress:
    """Steps done of `total`; `step(record)` per train record, `write(text)` for a status line."""

    def __init__(self, total: int, start: int = 0, *, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.done = total, start
        self._bar: Any = None
        self._redirect: contextlib.AbstractContextManager | None = None
        if _is_terminal(self.stream):
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total, initial=start, desc="qurl", dynamic_ncols=True,
                             file=self.stream)
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    def step(self, record: dict[str, Any]) -> None:
        """One train step done; `record` is its train record (SHOWN fields that are floats)."""
        self.done += 1
        shown = {k: f"{record[k]:.3g}" for k in SHOWN if isinstance(record.get(k), float)}
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(shown)
        else:
            fields = "".join(f" {k}={v}" for k, v in shown.items())
            print(f"qurl: step {self.done}/{self.total}{fields}", file=self.stream, flush=True)

    def write(self, text: str) -> None:
        """A status line on a line of its own (stdout; above the bar when there is one)."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
