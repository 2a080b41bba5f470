"""The controller's ledger of dispatched prompts: where each one is, so none is lost or trained twice.

A *dispatch* is one prompt sent to one worker slot at one policy version. It gets a run-unique,
increasing dispatch id `did`; its *key* `"<uid>@<did>"` names it on the wire (trajectories come back
under that key), so two dispatches of the same dataset prompt — a re-dispatch after a worker died, or
the same prompt in two overlapping epochs — never mix.

Life of a dispatch:

    dispatch() ──► in flight (held by slot s) ──group complete──► buffered ──trained──► gone
                         │                                           │
                         └──worker died / group stale──► returned ◄──┘ evicted stale
                             (caller puts the dataset index back into the cursor)

Trajectories for a key that is not in flight (a dead worker's late output, a duplicate, a replay
that slipped past the channel after a restart) are *late*: dropped and counted, never buffered.

Invariants:
- A dataset index taken from the cursor is, at every moment, in exactly one of: in flight, buffered,
  trained, or handed back to the caller for `put_back`. The checkpoint stores in-flight and buffered
  dispatches; on resume the in-flight ones go back to the cursor (`take_in_flight`).
- dids increase across the whole run (the counter is checkpointed), so keys never repeat.
- state_dict() is JSON-serialisable.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

_STATE_VERSION = 1


@dataclass(frozen=True)
class Dispatch:
    did: int  # run-unique dispatch id, increasing in dispatch order
    index: int  # dataset index (what the cursor handed out)
    uid: str  # dataset prompt uid (stable across runs)
    slot: int  # worker slot that holds it
    version: int  # learner policy version at dispatch (seeds use step = version + 1)

    @property
    def key(self) -> str:
        return f"{self.uid}@{self.did}"


def split_key(key: str) -> tuple[str, int]:
    """(uid, did) of a dispatch key; ValueError if it is not `<uid>@<int>`."""
    uid, at, did = key.rpartition("@")
    if not at or not uid or not did.isdigit():
        raise ValueError(f"dispatch key {key!r} is not '<uid>@<did>'")
    return uid, int(did)


class Ledger:
    """In-flight and buffered dispatches of one run (module docstring)."""

    def __init__(self) -> None:
        self.next_did = 0
        self._in_flight: dict[str, Dispatch] = {}  # key -> dispatch, in dispatch order
        self._buffered: dict[str, Dispatch] = {}
        self.stats: Counter[str] = Counter()

    def dispatch(self, index: int, uid: str, slot: int, version: int) -> Dispatch:
        d = Dispatch(self.next_did, int(index), uid, int(slot), int(version))
        self.next_did += 1
        self._in_flight[d.key] = d
        self.stats["dispatched"] += 1
        return d

    def in_flight(self, key: str) -> Dispatch | None:
        return self._in_flight.get(key)

    def buffered(self, key: str) -> Dispatch | None:
        return self._buffered.get(key)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_buffered(self) -> int:
        return len(self._buffered)

    def held_by(self, slot: int) -> list[Dispatch]:
        return [d for d in self._in_flight.values() if d.slot == slot]

    def load_of(self, slot: int) -> int:
        return sum(d.slot == slot for d in self._in_flight.values())

    def note_late(self, n: int = 1) -> None:
        self.stats["late"] += n

    def complete(self, key: str) -> Dispatch:
        """An in-flight dispatch's group is complete in the buffer."""
        d = self._in_flight.pop(key)
        self._buffered[key] = d
        self.stats["completed"] += 1
        return d

    def drop(self, key: str, why: str) -> Dispatch | None:
        """Forget an in-flight or buffered dispatch that will not be trained (stale); the caller puts
        its index back into the cursor. None if the key is unknown."""
        d = self._in_flight.pop(key, None) or self._buffered.pop(key, None)
        if d is not None:
            self.stats[f"dropped_{why}"] += 1
        return d

    def trained(self, keys: list[str]) -> list[Dispatch]:
        """Buffered dispatches consumed by a train step, in the order given."""
        out = [self._buffered.pop(k) for k in keys]
        self.stats["trained"] += len(out)
        return out

    def take_slot(self, slot: int) -> list[Dispatch]:
        """Remove and return (in dispatch order) everything in flight at `slot` (its worker died)."""
        held = self.held_by(slot)
        for d in held:
            del self._in_flight[d.key]
        self.stats["reassigned"] += len(held)
        return held

    def take_in_flight(self) -> list[Dispatch]:
        """Remove and return every in-flight dispatch, in dispatch order (resume)."""
        out = list(self._in_flight.values())
        self._in_flight.clear()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "next_did": self.next_did,
                "in_flight": [asdict(d) for d in self._in_flight.values()],
                "buffered": [asdict(d) for d in self._buffered.values()],
                "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"ledger state: expected a dict with version {_STATE_VERSION}")
        try:
            in_flight = [Dispatch(**d) for d in state["in_flight"]]
            buffered = [Dispatch(**d) for d in state["buffered"]]
            next_did = int(state["next_did"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"ledger state malformed: {e}") from None
        if any(d.did >= next_did for d in in_flight + buffered):
            raise ValueError("ledger state: a dispatch id is >= next_did")
        self.next_did = next_did
        self._in_flight = {d.key: d for d in in_flight}
        self._buffered = {d.key: d for d in buffered}
        self.stats = Counter(state.get("stats", {}))
