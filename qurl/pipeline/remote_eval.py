"""The async actor's evaluation, answered by the rollout workers (issue 59 item 7).

The async controller holds no engine: its workers hold the 8-bit actor (SGLang servers on GPU,
local decoders on CPU). The Evaluator (qurl/train/eval_suite.py) builds its requests as always
(greedy, then Avg@k with their own seeds, `request_seed(run seed, EVAL_STEP, uid, j)`) and asks a
`Generator` for the answers; in async runs that generator is `WorkerEval`, which sends them down
the workers' ordinary task path:

    generate(requests)   one round r: request i travels as a one-sample prompt task keyed
                         `e<r>.<i>` with its own sampling params (seed included) and meta
                         `eval`, to the ready workers in contiguous shares, one burst each; the
                         worker runs it as given and answers unscored (worker.py)
    file(msg)            a trajectory message marked `eval` (the controller routes every one
                         here, never to the dispatcher): answers of the open round are kept as
                         the engine's results; anything else is late and dropped
    the wait             the controller's housekeeping runs as while collecting a batch: dead
                         workers are restarted (their training prompts go back to the cursor,
                         their unanswered requests are sent again to whoever is ready), a weight
                         push a new or resyncing worker needs is done first (of the same version);
                         training trajectories that arrive are filed as ever

Invariants: every request is answered exactly once, by an engine holding the version evaluated
(the last one published; an answer with a token of any other version is asked again), whose
weights were verified where the engine verifies (a worker takes no task before); answers never
reach the dispatcher's ledger, so they are never trained; no training prompt is dispatched while
a round is open (workers finish the ones they hold). The answers are scored by the Evaluator, by
the code that scores a local engine's, into the same `eval/...` keys: an async run's evaluation
equals a local engine's on the same weights (tests/test_worker_eval.py).
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

import torch

from qurl.pipeline.payload import PromptTask, pack_prompt
from qurl.types import GenRequest, GenResult

STALL_TIMEOUT_S = 900.0  # no answer for this long: give up (the workers' logs say why)


def _key(round_: int, index: int) -> str:
    return f"e{round_}.{index}"


def _parse(key: str) -> tuple[int, int] | None:
    """(round, index) of an evaluation key; None for anything else."""
    head, dot, tail = key.partition(".")
    if not dot or not head.startswith("e") or not head[1:].isdigit() or not tail.isdigit():
        return None
    return int(head[1:]), int(tail)


class WorkerEval:
    """A `Generator` (qurl/train/eval_suite.py) whose engines are the async workers.

    fleet: the controller's Fleet; tend(): the controller's housekeeping between polls (raises
    a halt, restarts dead workers, re-pushes the version when needed) returning the slots
    replaced; on_train(msg): files a training trajectory message."""

    def __init__(self, fleet: Any, tokenizer: Any, tend: Callable[[], list[int]],
                 on_train: Callable[[Any], None]) -> None:
        self.fleet, self.tokenizer, self.tend, self.on_train = fleet, tokenizer, tend, on_train
        self.version = -1  # set by the controller to the version just published
        self.round = 0  # run-unique id of the open (or last) round: late answers are told apart
        self.counts: Counter[str] = Counter()
        self._requests: list[GenRequest] = []
        self._held: dict[int, int] = {}  # request index -> slot it was sent to, unanswered
        self._todo: list[int] = []  # request indices to send (again)
        self._out: dict[int, GenResult] = {}
        self._open = False

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Every request's answer from the workers at `self.version`, in request order."""
        self.round += 1
        self._requests, self._held, self._out = list(requests), {}, {}
        self._todo, self._open = list(range(len(requests))), True
        last, have = time.monotonic(), 0
        try:
            while len(self._out) < len(requests):
                for slot in self.tend():
                    lost = sorted(i for i, s in self._held.items() if s == slot)
                    for i in lost:
                        del self._held[i]
                    self._todo += lost
                ready = self.fleet.ready_slots()
                if self._todo and ready:
                    self._send(ready)
                for msg in self.fleet.poll(timeout_ms=20):
                    if msg.meta.get("eval"):
                        self.file(msg)
                    else:
                        self.on_train(msg)
                if len(self._out) > have:
                    last, have = time.monotonic(), len(self._out)
                elif time.monotonic() - last > STALL_TIMEOUT_S:
                    raise RuntimeError(f"evaluation v{self.version}: no answer from the workers "
                                       f"for {STALL_TIMEOUT_S:.0f}s ({have}/{len(requests)})")
        finally:
            self._open = False
        self.counts["eval_requests"] += len(requests)
        return [self._out[i] for i in range(len(requests))]

    def _send(self, ready: list[int]) -> None:
        """The requests to send, in contiguous shares over the ready slots (one burst each: the
        worker generates its share as one batch, as a local engine would the whole)."""
        todo, self._todo = sorted(self._todo), []
        share = -(-len(todo) // len(ready))
        for k, slot in enumerate(ready):
            part = todo[k * share:(k + 1) * share]
            for n, i in enumerate(part):
                req = self._requests[i]
                task = PromptTask(prompt_uid=_key(self.round, i),
                                  prompt_ids=torch.tensor(req.prompt_ids, dtype=torch.int64),
                                  params=req.params, group_size=1, version=self.version)
                meta, tensors = pack_prompt(task)
                meta.update(key=task.prompt_uid, answer="", eval=1, burst_end=n == len(part) - 1)
                if self.fleet.send_prompt(slot, meta, tensors):
                    self._held[i] = slot
                else:
                    self._todo.append(i)  # not queued: sent again on the next turn

    def file(self, msg: Any) -> None:
        """Keep the answers of the open round (module docstring); drop the rest as late."""
        for t in msg.payload:
            parsed = _parse(t.prompt_uid)
            if not self._open or parsed is None or parsed[0] != self.round \
                    or parsed[1] not in self._held:
                self.counts["eval_late"] += 1
                continue
            i = parsed[1]
            del self._held[i]
            if bool((t.versions != self.version).any()):  # not the version evaluated: ask again
                self.counts["eval_wrong_version"] += 1
                self._todo.append(i)
                continue
            req = self._requests[i]
            self._out[i] = GenResult(rid=req.rid, prompt_ids=req.prompt_ids,
                                     output_ids=t.response_ids, logprobs=t.behav_logp,
                                     versions=t.versions, finish_reason=t.finish_reason,
                                     routed_experts=t.routed_experts)
