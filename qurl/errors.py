"""Errors a user can fix by changing their input: a config field, a data row, a run directory.

Each carries one line that names what is wrong (the field, file and line, or checkpoint file).
The command line prints that line and exits with status 2, on whichever learner rank the error
was found (qurl/deploy/ranks.py); any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations


class InputError(ValueError):
    """Bad user input; str(e) is one line naming the field, file/line or file at fault."""


class CheckpointError(InputError):
    """A run directory has no checkpoint that can be resumed (none written, or none intact)."""
