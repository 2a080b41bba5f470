"""The bookkeeping of the async loop: which prompt goes to which worker, when, and what comes back.

One object owns the four pieces of state that must move together for nothing to be lost or trained
twice: the data cursor (what is next), the staleness controller (may we dispatch now), the
trajectory buffer (complete groups waiting to be trained) and the ledger (where each dispatched
prompt is). The controller calls:

    dispatch(version, ready_slots, send)   while the AReaL rule allows and the run still needs
                                           groups: take prompts, assign them to the least-loaded
                                           ready slot, send them (one burst per slot)
    accept(trajectories, version)          file a worker's trajectories; late ones (not in flight)
                                           are dropped, a stale group's prompt is put back; with
                                           dynamic sampling (DAPO) a complete group whose
                                           accuracies are all equal is filtered: its prompt is
                                           consumed and its unit released, so another is sent
    reclaim(slot)                          a replaced worker's prompts go back to the cursor
    pop_batch(version)                     B complete groups, in dispatch order, or None

Invariants (with `remaining` the groups the run still needs):
- every dataset index taken from the cursor is in flight, buffered, trained, filtered (dynamic
  sampling), or put back;
- accepted + running never exceeds (η + version + 1)·B at dispatch time, and tokens older than
  version − η are never trained (the buffer drops them; their prompts are put back);
- `state_dict()` after any call and `load_state_dict()` in a new process continue the same
  accounting, with the prompts that were in flight put back first in line.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Sequence

import torch

from qurl.data.cursor import DataCursor
from qurl.data.datasets import Example
from qurl.pipeline.ledger import Dispatch, Ledger
from qurl.pipeline.staleness import StalenessController, TrajectoryBuffer
from qurl.train.dynamic_sampling import informative
from qurl.pipeline.payload import PromptTask, pack_prompt
from qurl.types import SamplingParams, Trajectory

Send = Callable[[int, dict[str, Any], dict[str, torch.Tensor]], bool]


class Dispatcher:
    def __init__(self, train_set: Sequence[Example], *, batch_size: int, group_size: int,
                 max_staleness: int, total_steps: int, seed: int,
                 encode: Callable[[str], list[int]], params: SamplingParams,
                 dynamic_sampling: bool = False) -> None:
        self.train_set, self.B, self.G = train_set, batch_size, group_size
        self.dynamic_sampling = dynamic_sampling
        self.total_steps, self.encode, self.params = total_steps, encode, params
        self.cursor = DataCursor(len(train_set), seed=seed)
        self.staleness = StalenessController(batch_size, max_staleness)
        self.buffer = TrajectoryBuffer(group_size, max_staleness)
        self.ledger = Ledger()
        self.counts: Counter[str] = Counter()
        self._ids: dict[int, torch.Tensor] = {}

    def remaining(self, version: int) -> int:
        """Groups the run still needs that are neither buffered nor in flight (version == steps
        trained so far)."""
        return ((self.total_steps - version) * self.B - self.ledger.num_buffered
                - self.ledger.num_in_flight)

    def _prompt_ids(self, index: int) -> torch.Tensor:
        if index not in self._ids:
            self._ids[index] = torch.tensor(self.encode(self.train_set[index].prompt),
                                            dtype=torch.int64)
        return self._ids[index]

    def dispatch(self, version: int, ready: Sequence[int], send: Send) -> int:
        """Dispatch as many prompts as allowed to the ready slots; returns how many were sent.
        `send(slot, meta, tensors)` returns False when a message could not be queued."""
        if not ready:
            return 0
        bursts: dict[int, list[int]] = {}
        n = 0
        while self.staleness.can_dispatch(version) and self.remaining(version) - n > 0:
            slot = min(ready, key=lambda s: (self.ledger.load_of(s) + len(bursts.get(s, ())), s))
            bursts.setdefault(slot, []).extend(self.cursor.take(1))
            self.staleness.on_dispatch(1)
            n += 1
        sent = 0
        for slot, indices in bursts.items():
            for k, index in enumerate(indices):
                ex = self.train_set[index]
                d = self.ledger.dispatch(index, ex.uid, slot, version)
                task = PromptTask(prompt_uid=ex.uid, prompt_ids=self._prompt_ids(index),
                                  params=self.params, group_size=self.G, version=version)
                meta, tensors = pack_prompt(task)
                # the worker tags its trajectories with `key` and scores them by `answer` / `answer_kind`;
                # `burst_end` lets it start generating
                meta.update(key=d.key, answer=ex.answer, answer_kind=ex.answer_kind,
                            burst_end=k == len(indices) - 1)
                if send(slot, meta, tensors):
                    sent += 1
                else:
                    self.put_back(d.key, "unsent")
        return sent

    def put_back(self, key: str, why: str) -> Dispatch | None:
        """A dispatch that will not be trained (stale, unsent, evicted): its prompt goes back to the
        cursor and its unit of the staleness budget is released."""
        accepted = self.ledger.buffered(key) is not None
        d = self.ledger.drop(key, why)
        if d is None:
            return None
        self.cursor.put_back([d.index])
        if accepted:  # it had been counted as accepted but will never be trained
            self.staleness.accepted -= 1
        else:
            self.staleness.on_reject(1)
        return d

    def reclaim(self, slot: int) -> int:
        """A replaced worker's prompts go back to the cursor (re-dispatched before new ones)."""
        lost = self.ledger.take_slot(slot)
        self.cursor.put_back(d.index for d in lost)
        self.staleness.on_reject(len(lost))
        self.counts["redispatched"] += len(lost)
        return len(lost)

    def accept(self, trajs: Sequence[Trajectory], version: int) -> int:
        """File trajectories whose prompt_uid is a dispatch key. Returns the groups completed."""
        by_key: dict[str, list[Trajectory]] = {}
        for t in trajs:
            by_key.setdefault(t.prompt_uid, []).append(t)
        completed = 0
        for key, group in by_key.items():
            if self.ledger.in_flight(key) is None:
                self.ledger.note_late(len(group))
                continue
            for t in group:
                status = self.buffer.put(t, version)
                if status == "complete":
                    self.ledger.complete(key)
                    if self.dynamic_sampling and not informative(self.buffer.group(key)):
                        self.buffer.discard_complete(key)
                        self.ledger.drop(key, "uniform")  # consumed, not trained, not put back
                        self.staleness.on_reject(1)  # frees its unit: the next prompt replaces it
                        break
                    self.staleness.on_accept(1)
                    completed += 1
                elif status == "stale":
                    self.put_back(key, "stale")
                    break
        return completed

    def pop_batch(self, version: int) -> tuple[list[list[Trajectory]], list[Dispatch]] | None:
        """B complete groups (the earliest completed, each sorted by sample) in dispatch order,
        with their dispatches; None until B are complete. Groups gone stale are evicted first."""
        for key in self.buffer.evict_stale(version):
            self.put_back(key, "evicted")
        groups = self.buffer.pop_batch(self.B)
        if groups is None:
            return None
        groups.sort(key=lambda g: self.ledger.buffered(g[0].prompt_uid).did)
        return groups, self.ledger.trained([g[0].prompt_uid for g in groups])

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor.state_dict(), "buffer": self.buffer.state_dict(),
                "staleness": self.staleness.state_dict(), "ledger": self.ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any], version: int) -> int:
        """Continue from a checkpoint taken at `version`. A synchronous loop's checkpoint has only
        the cursor (nothing was buffered or in flight). Returns how many in-flight prompts were
        put back for re-dispatch."""
        self.cursor.load_state_dict(state["cursor"])
        if "ledger" not in state:
            self.staleness.accepted = version * self.B
            return 0
        self.buffer.load_state_dict(state["buffer"])
        self.staleness.load_state_dict(state["staleness"])
        self.ledger.load_state_dict(state["ledger"])
        lost = self.ledger.take_in_flight()  # their results died with the old controller
        self.cursor.put_back(d.index for d in lost)
        self.staleness.on_reject(len(lost))
        return len(lost)
