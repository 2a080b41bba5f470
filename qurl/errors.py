"""Errors that end a command with one line: bad input a user can fix (a config field, a data row,
a run directory), and a run stopped by one of its own checks (`RunHalted`).

Each carries one line that names what is wrong (the field, file and line, or checkpoint file; the
engine and tensors of a failed weight verification; the alarm that fired). The command line prints
that line and exits with status 2, on whichever learner rank the error was found
(qurl/commands/ranks.py); any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations


class InputError(ValueError):
    """Bad user input; str(e) is one line naming the field, file/line or file at fault."""


class CheckpointError(InputError):
    """A run directory has no checkpoint that can be resumed (none written, or none intact)."""


class RunHalted(InputError):
    """A run stopped by a check it makes on itself: an engine that still differs from the
    learner's weights after a full resync (qurl/weights/publish.py, qurl/pipeline/fleet.py), or the
    mismatch alarm with deploy.alarm.stop (qurl/train/alarm.py). Nothing after the last
    checkpoint is kept as trained: fix the cause and `qurl train --resume <run dir>`. An
    InputError so every path that starts ranks (spawned processes, torchrun, in-process) prints it
    as its one line."""
