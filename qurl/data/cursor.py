"""A deterministic, resumable order over a dataset of N examples.

Training draws prompts epoch by epoch: each epoch visits every index in [0, N) exactly once, in a
permutation seeded by (seed, epoch) alone. The cursor is the position in that stream, so its whole
state is a few integers, and `take` after `load_state_dict(state_dict())` continues the exact sequence
an uninterrupted cursor would have produced — across process restarts, across epoch boundaries.

Prompts can also be *put back*: indices that were taken but whose results never arrived (in flight at
a crash, an aborted rollout) go to a front queue that `take` serves, first in first out, before
drawing new ones. The queue is part of the state, so a resume neither loses nor repeats a prompt.

Invariants:
- The permutation of epoch e depends only on (seed, e): resuming never reshuffles past positions.
- state_dict() is JSON-serialisable (ints and a list of ints).
- A put-back index is served exactly once more per put_back call.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

__all__ = ["DataCursor"]

_STATE_VERSION = 1


def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """[n] int64 permutation for one epoch; SeedSequence mixes (seed, epoch) into independent streams."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(n)


class DataCursor:
    """Epoch-shuffled stream of indices into a dataset of size n, with a requeue for put-back indices."""

    def __init__(self, n: int, seed: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"DataCursor n must be a positive int, got {n!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"DataCursor seed must be a non-negative int, got {seed!r}")
        self._n = n
        self._seed = seed
        self._epoch = 0
        self._position = 0
        self._requeue: deque[int] = deque()
        self._perm = _permutation(n, seed, 0)

    @property
    def n(self) -> int:
        return self._n

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def epoch(self) -> int:
        """Epoch of the next fresh index (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many fresh indices of the current epoch have been taken (0 <= position < n)."""
        return self._position

    @property
    def pending(self) -> list[int]:
        """Put-back indices waiting to be served, in the order `take` will return them."""
        return list(self._requeue)

    def take(self, k: int) -> list[int]:
        """The next k indices: put-back ones first, then fresh ones, crossing epochs as needed."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"take(k) needs a non-negative int, got {k!r}")
        out: list[int] = []
        while len(out) < k and self._requeue:
            out.append(self._requeue.popleft())
        while len(out) < k:
            step = min(k - len(out), self._n - self._position)
            out.extend(int(i) for i in self._perm[self._position : self._position + step])
            self._position += step
            if self._position == self._n:
                self._epoch += 1
                self._position = 0
                self._perm = _permutation(self._n, self._seed, self._epoch)
        return out

    def put_back(self, indices: Iterable[int]) -> None:
        """Queue indices to be re-served (before any fresh one), in the given order."""
        items = list(indices)
        for i in items:
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or not 0 <= int(i) < self._n:
                raise ValueError(f"put_back index {i!r} is not an int in [0, {self._n})")
        self._requeue.extend(int(i) for i in items)

    def state_dict(self) -> dict:
        return {
            "version": _STATE_VERSION,
            "n": self._n,
            "seed": self._seed,
            "epoch": self._epoch,
            "position": self._position,
            "requeue": list(self._requeue),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by state_dict(); refuses one saved for another dataset size or seed."""
        if not isinstance(state, dict):
            raise ValueError(f"cursor state must be a dict, got {type(state).__name__}")
        for key in ("version", "n", "seed", "epoch", "position", "requeue"):
            if key not in state:
                raise ValueError(f"cursor state is missing field '{key}'")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"cursor state field 'version' is {state['version']!r}, expected {_STATE_VERSION}")
        for key, mine in (("n", self._n), ("seed", self._seed)):
            if state[key] != mine:
                raise ValueError(f"cursor state field '{key}' is {state[key]!r} but this cursor has {mine!r}")
        epoch, position, requeue = state["epoch"], state["position"], state["requeue"]
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"cursor state field 'epoch' must be a non-negative int, got {epoch!r}")
        if not isinstance(position, int) or not 0 <= position < self._n:
            raise ValueError(f"cursor state field 'position' must be an int in [0, {self._n}), got {position!r}")
        if not isinstance(requeue, list) or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self._n for i in requeue
        ):
            raise ValueError(f"cursor state field 'requeue' must be a list of ints in [0, {self._n})")
        self._epoch = epoch
        self._position = position
        self._requeue = deque(requeue)
        self._perm = _permutation(self._n, self._seed, epoch)

    def __repr__(self) -> str:
        return (
            f"DataCursor(n={self._n}, seed={self._seed}, epoch={self._epoch}, "
            f"position={self._position}, pending={len(self._requeue)})"
        )
