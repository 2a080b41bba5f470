"""Staleness control for asynchronous RL: when may a prompt be dispatched, and which trajectories
are fresh enough to train on.

Dispatch rule (AReaL). With policy version v (= number of completed train steps), batch size B
(samples consumed per step, in whatever unit the caller counts dispatches in) and bound η
(max_staleness), a new dispatch is allowed iff

    (η + v + 1) · B − (accepted + running) > 0

where `accepted` counts everything accepted so far (trained or buffered) and `running` what is in
flight. So at most (η + v + 1)·B units are ever produced by the time the learner is at version v:
data sampled at version v is consumed by step v + η at the latest. η = 0 is synchronous: exactly B
units at version 0, the next B only after the first step. Rejected or lost work leaves `running`
without entering `accepted`, freeing its slot.

Buffer. Trajectories are grouped by prompt_uid; a group is complete when all G sample indices have
arrived, and complete groups leave FIFO in completion order. A trajectory whose oldest token version
is older than `current_version − max_staleness` is stale: it is dropped and counted, and with it its
whole group (a group missing a sample cannot be trained with group-normalised advantages); later
siblings of a dropped group are dropped on arrival too, until all G have been seen. A second copy of
an already-present (prompt_uid, sample_idx) is dropped as a duplicate (e.g. a re-dispatched prompt).
`state_dict` is lossless and owns its tensors (clones, so a checkpoint never drags in the whole
receive buffer a trajectory view points into).
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Any

from qurl.types import Trajectory


class StalenessController:
    """AReaL's bounded-staleness dispatch rule (module docstring)."""

    def __init__(self, batch_size: int, max_staleness: int):
        if batch_size < 1 or max_staleness < 0:
            raise ValueError(f"batch_size={batch_size} must be >= 1, max_staleness={max_staleness} >= 0")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.accepted = 0
        self.running = 0

    def capacity(self, version: int) -> int:
        """How many more units may be dispatched at policy `version` (may be <= 0)."""
        return (self.max_staleness + version + 1) * self.batch_size - (self.accepted + self.running)

    def can_dispatch(self, version: int) -> bool:
        return self.capacity(version) > 0

    def on_dispatch(self, n: int = 1) -> None:
        self.running += n

    def _finish(self, n: int) -> None:
        if not 0 <= n <= self.running:
            raise ValueError(f"finishing {n} units but only {self.running} are running")
        self.running -= n

    def on_accept(self, n: int) -> None:
        self._finish(n)
        self.accepted += n

    def on_reject(self, n: int) -> None:
        self._finish(n)

    def state_dict(self) -> dict[str, int]:
        return {"batch_size": self.batch_size, "max_staleness": self.max_staleness,
                "accepted": self.accepted, "running": self.running}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["batch_size"], state["max_staleness"]) != (self.batch_size, self.max_staleness):
            raise ValueError(f"checkpointed batch_size/max_staleness {state['batch_size']}/"
                             f"{state['max_staleness']} differ from {self.batch_size}/{self.max_staleness}")
        self.accepted, self.running = int(state["accepted"]), int(state["running"])


_TENSOR_FIELDS = ("prompt_ids", "response_ids", "behav_logp", "versions")
_SCALAR_FIELDS = ("prompt_uid", "sample_idx", "reward", "finish_reason", "reward_timed_out")


def _traj_to_dict(t: Trajectory) -> dict[str, Any]:
    d: dict[str, Any] = {f: getattr(t, f).clone() for f in _TENSOR_FIELDS}
    d.update({f: getattr(t, f) for f in _SCALAR_FIELDS})
    for f in ("behav_entropy", "routed_experts"):  # optional: absent when None
        if getattr(t, f) is not None:
            d[f] = getattr(t, f).clone()
    return d


def _traj_from_dict(d: dict[str, Any]) -> Trajectory:  # checkpoints older than either field too
    return Trajectory(**{f: d[f] for f in _TENSOR_FIELDS + _SCALAR_FIELDS},
                      behav_entropy=d.get("behav_entropy"), routed_experts=d.get("routed_experts"))


class TrajectoryBuffer:
    """Accepted trajectories grouped by prompt, released as complete groups (module docstring)."""

    def __init__(self, group_size: int, max_staleness: int):
        if group_size < 1 or max_staleness < 0:
            raise ValueError(f"group_size={group_size} must be >= 1, max_staleness={max_staleness} >= 0")
        self.group_size = group_size
        self.max_staleness = max_staleness
        self._groups: OrderedDict[str, dict[int, Trajectory]] = OrderedDict()  # incomplete + complete
        self._complete: deque[str] = deque()
        self._dropped: dict[str, set[int]] = {}  # uid of a dropped group -> sample indices seen
        self.stats: Counter[str] = Counter()

    def is_stale(self, traj: Trajectory, current_version: int) -> bool:
        if traj.versions.numel() == 0:  # no token, no age: never stale
            return False
        return int(traj.versions.min()) < current_version - self.max_staleness

    def put(self, traj: Trajectory, current_version: int) -> str:
        """Add one trajectory. Returns what happened: "kept", "complete" (its group is now complete),
        "stale" (dropped with its group), "dropped_group" (sibling of a dropped group),
        "duplicate", or "bad_sample_idx"."""
        uid, idx = traj.prompt_uid, traj.sample_idx
        if not 0 <= idx < self.group_size:
            self.stats["bad_sample_idx"] += 1
            return "bad_sample_idx"
        if uid in self._dropped:
            status = "duplicate" if idx in self._dropped[uid] else "dropped_group"
            self._note_dropped(uid, idx)
            self.stats[status] += 1
            return status
        group = self._groups.get(uid, {})
        if idx in group:
            self.stats["duplicate"] += 1
            return "duplicate"
        if self.is_stale(traj, current_version):
            self.stats["stale"] += 1
            self._drop_group(uid)
            self._note_dropped(uid, idx)
            return "stale"
        group[idx] = traj
        self._groups[uid] = group
        self.stats["kept"] += 1
        if len(group) == self.group_size:
            self._complete.append(uid)
            return "complete"
        return "kept"

    def _drop_group(self, uid: str) -> None:
        group = self._groups.pop(uid, {})
        self._dropped[uid] = set(group)
        self.stats["groups_dropped"] += 1
        self.stats["dropped_with_group"] += len(group)
        if uid in self._complete:
            self._complete.remove(uid)

    def _note_dropped(self, uid: str, idx: int) -> None:
        seen = self._dropped[uid]
        seen.add(idx)
        if len(seen) == self.group_size:  # every sample accounted for: forget the uid
            del self._dropped[uid]

    def evict_stale(self, current_version: int) -> list[str]:
        """Drop buffered groups (complete or not) holding a trajectory that has become stale.
        Returns their prompt_uids so the caller can account for them."""
        stale = [uid for uid, g in self._groups.items()
                 if any(self.is_stale(t, current_version) for t in g.values())]
        for uid in stale:
            n_stale = sum(self.is_stale(t, current_version) for t in self._groups[uid].values())
            self._drop_group(uid)
            self.stats["stale"] += n_stale  # the rest of the group counts as dropped_with_group
            self.stats["dropped_with_group"] -= n_stale
        return stale

    def pop_batch(self, n_groups: int, current_version: int | None = None) -> list[list[Trajectory]] | None:
        """The n_groups earliest-completed groups, each sorted by sample_idx, or None if fewer are
        complete. With current_version, groups that became stale meanwhile are evicted first."""
        if current_version is not None:
            self.evict_stale(current_version)
        if len(self._complete) < n_groups:
            return None
        out = []
        for _ in range(n_groups):
            group = self._groups.pop(self._complete.popleft())
            out.append([group[i] for i in sorted(group)])
        self.stats["groups_popped"] += n_groups
        return out

    def group(self, uid: str) -> list[Trajectory]:
        """The buffered samples of one prompt, sorted by sample_idx (left in the buffer)."""
        group = self._groups[uid]
        return [group[i] for i in sorted(group)]

    def discard_complete(self, uid: str) -> None:
        """Remove one complete group without training it (DAPO's filter); every sample has
        arrived, so nothing more is expected for it."""
        self._complete.remove(uid)
        del self._groups[uid]

    @property
    def num_complete(self) -> int:
        return len(self._complete)

    def pending_uids(self) -> list[str]:
        """prompt_uids with buffered trajectories (complete or not), oldest first."""
        return list(self._groups)

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def state_dict(self) -> dict[str, Any]:
        return {
            "group_size": self.group_size, "max_staleness": self.max_staleness,
            "groups": [[uid, [_traj_to_dict(g[i]) for i in sorted(g)]] for uid, g in self._groups.items()],
            "complete": list(self._complete),
            "dropped": {uid: sorted(s) for uid, s in self._dropped.items()},
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["group_size"], state["max_staleness"]) != (self.group_size, self.max_staleness):
            raise ValueError(f"checkpointed group_size/max_staleness {state['group_size']}/"
                             f"{state['max_staleness']} differ from {self.group_size}/{self.max_staleness}")
        self._groups = OrderedDict()
        for uid, trajs in state["groups"]:
            self._groups[uid] = {d["sample_idx"]: _traj_from_dict(d) for d in trajs}
        self._complete = deque(state["complete"])
        if any(uid not in self._groups or len(self._groups[uid]) != self.group_size
               for uid in self._complete):
            raise ValueError("buffer state: a group listed complete is missing or incomplete")
        self._dropped = {uid: set(s) for uid, s in state["dropped"].items()}
        self.stats = Counter(state["stats"])
