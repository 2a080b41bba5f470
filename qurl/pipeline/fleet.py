"""The controller's side of its rollout workers: sockets, liveness, the weight group, weight pushes.

Topology:
- every worker binds its own PULL socket and announces it in its (authenticated) hello; the
  controller *connects* one PUSH per worker slot to it. That socket carries prompts *and* control
  messages, so a worker sees them in the order they were sent (a weight update before the prompts
  dispatched after it), and — because a connecting PUSH has exactly the one peer it connected to —
  no other process can attach to it and siphon off prompts, and the controller always knows which
  worker holds which prompt;
- the controller binds one PULL (`inbound`, published in controller.json) for everything workers
  send: trajectory batches and control (hello, synced).
Every message is authenticated with the run key and validated by channel.py; rejects
(forged, replayed, truncated, oversized, invalid) are counted there and never reach the caller.

Liveness and the weight group. A torch.distributed group has fixed membership, so whenever the set
of workers changes (start, a worker died and was restarted, a worker left after a failed sync) the
whole group is re-formed: the controller invites every live worker (`group` op with a fresh
rendezvous port and generation number), hosts rank 0 itself, and re-broadcasts the current weights
from its cached chunks (no learner collective needed). A slot is *ready* — may receive prompts —
only once it is in the current group and has the current weights.

Delta syncs (qurl/weights/plan.py). A version goes as a delta against the previous one only when
the group has not been re-formed since that version was broadcast to it (so every member received
it) and no worker has asked for a full sync since; the first announcement carries the header
(base, digests). Each worker refuses a delta whose base it does not hold verified and checks
every sync against the digests (worker.py); either failure comes back as a `resync`
control message with its reason, counted (`resync/<reason>`), and the current version is sent
again in full. A worker whose full resync fails verification too (two mismatches in a row) stops
the run: `halted` holds the one-line error naming the slot, its engine and the tensors, and the
controller raises it (the rule, per slot, is qurl/weights/resync.py `ResyncRule`, the same one the
synchronous loop applies to its engine). Prompts whose generation a failed sync
abandoned are counted as `unverified_redone` (the worker queues them again). Deltas need every member's engine to apply them: each worker says in its hello
whether it can (`deltas`: its engine has `verify` — the local engine, and an SGLang adapter whose
one server runs qurl's sync loader, at TP 1 or at a TP size whose cut qurl maps,
qurl/engines/sglang/verified_sync.py); while any slot cannot, every
version goes in full (counted as `unsupported`). A worker that gets a delta anyway refuses it
(qurl/weights/receiver.py) and the group is re-formed and sent the version in full. A version equal
to the last one (a step without gradient: an empty delta) sends its smallest tensor whole, since
a broadcast needs a tensor.

A group whose members advertised addresses that cannot reach each other (a loopback address
toward another node: qurl/weights/group.py) fails at once with one line naming every member's
address (an InputError: the command prints it and exits 2), not after MAX attempts.

A worker's identity is its pid (from its hello). A slot whose process exited (`WorkerProcs.poll`) or
whose hello comes from a new pid is *replaced*: its socket is closed (queued messages to the dead
process are discarded) and `take_replaced()` reports it once so the controller re-dispatches
whatever that slot held.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from qurl.config import StreamDeployConfig
from qurl.engines.kind import EngineKind
from qurl.engines.sglang.launcher import STOP_WAIT_S
from qurl.pipeline.procs import WorkerProcs
from qurl.pipeline.session import write_session
from qurl.errors import RunHalted
from qurl.weights.plan import SyncPlan, SyncPlanner, broadcast_chunks
from qurl.weights.resync import OK, OTHER, RESYNC_REASONS, ResyncRule
from qurl.errors import InputError
from qurl.weights.broadcaster import Broadcaster, GroupFormError, GroupSpec
from qurl.weights.group import GroupAddressError
from qurl.weights.settings import SyncSettings

log = logging.getLogger("qurl.fleet")

GROUP_TIMEOUT_S = 120.0  # rendezvous and every broadcast of the weight group
JOIN_TIMEOUT_S = 600.0  # a worker must say hello within this (process start + engine build)
PING_EVERY_S = 2.0
MAX_RESTARTS = 10  # per slot and run: a worker that keeps dying is a bug to report, not to retry


@dataclass
class _SlotState:
    pid: int | None = None  # from the worker's latest hello
    gen_seen: int = -1  # latest group generation the worker reported having been invited to
    ready: bool = False  # in the current group with the current weights
    deltas: bool = False  # the worker's engine can apply (and verify) deltas, from its hello


class Fleet:
    def __init__(self, run_dir: Path, key: bytes, model_dir: str, *, engines: int, host: str,
                 stream: StreamDeployConfig, sync: SyncSettings, kind: EngineKind,
                 vocab_size: int, max_len: int, spawn: bool = True, worker_threads: int = 0,
                 planner: SyncPlanner | None = None,
                 moe: tuple[int, int, int] | None = None) -> None:
        """engines: deploy.engines (one worker slot each); host: deploy.host (the inbox and the
        weight group); stream: `[deploy.stream]`; sync: the run's sync settings (the weight
        group's port, backend, bucket size; the planner's mode when `planner` is None); kind: the
        workers' engines (their stop grace and environment); vocab_size / max_len: bounds of a
        trajectory message (max_len: the longest answer asked, rollouts or evaluations); moe: (L, k, E)
        of a mixture-of-experts model, whose trajectories carry routed experts (None: dense)."""
        from qurl.pipeline.channel import Receiver, Sender

        self.run_dir, self.key, self.stream = Path(run_dir), key, stream
        self.n = engines
        self.senders: list[Sender | None] = [None] * self.n  # connected on the worker's hello
        self.inbox = Receiver(f"tcp://{host}:{stream.port}", key, bind=True,
                              kinds=("trajectory", "control"), hwm=stream.hwm,
                              vocab_size=vocab_size,  # answers: rollouts or evaluations
                              max_len=max_len, moe=moe)
        self.session = secrets.token_hex(8)
        write_session(self.run_dir, {
            "session": self.session, "inbound": self.inbox.endpoint, "model_dir": str(model_dir),
            "num_workers": self.n, "pid": os.getpid()})
        self.slots = [_SlotState() for _ in range(self.n)]
        # each slot's mismatch streak and what follows a sync it reports (qurl/weights/resync.py)
        self.resync = ResyncRule()
        # A worker stops its SGLang servers itself (SIGTERM to the worker, then `finally`; a server
        # runs in its own session, so a SIGKILLed worker would leave it running): wait that long,
        # its watchdog's join (5 s) and its servers' SIGTERM -> SIGKILL escalation, all servers
        # together (launcher.stop_all), with 10 s to spare.
        grace = 2 * STOP_WAIT_S + 15.0 if kind.worker_stop_waits_for_server else 5.0
        from qurl.node.placement import spawned_worker_env

        self.procs = WorkerProcs(self.run_dir, self.n, threads=worker_threads, grace_s=grace,
                                 extra_env=spawned_worker_env(kind.servers_attached)
                                 ) if spawn else None
        self.weights = Broadcaster(host, sync.port, sync.worker_backend,
                                   name=f"qurl_weights_{self.session}",
                                   bucket_bytes=sync.bucket_bytes, timeout_s=GROUP_TIMEOUT_S)
        self.need_group = True
        self.need_full = False  # a worker asked for a full sync (refused delta, failed verify)
        self.planner = planner or SyncPlanner.of(sync)
        self._holder: tuple[int, str] | None = None  # what every group member was last sent
        self._replaced: list[int] = []
        self.sync_acks: list[dict[str, Any]] = []  # "synced" acks since the caller last took them
        self.counts: Counter[str] = Counter()
        self._last_ping = 0.0
        # set when a worker fails verification twice in a row: the controller raises it (never
        # from inside `push`, whose retry loop would swallow it)
        self.halted: RunHalted | None = None

    # ------------------------------------------------------------------ processes and messages

    def start(self) -> None:
        if self.procs is not None:
            self.procs.start_all()

    def _replace(self, slot: int, why: str) -> None:
        log.warning("worker slot %d replaced (%s)", slot, why)
        self.slots[slot] = _SlotState()
        self.resync.forget(slot)  # a new worker starts with no failed verification
        if self.senders[slot] is not None:
            self.senders[slot].close(linger_ms=0)  # whatever was queued for the dead one is void
            self.senders[slot] = None
        self._replaced.append(slot)
        self.counts["workers_replaced"] += 1
        self.need_group = True

    def check_procs(self) -> None:
        """Restart workers whose process exited (each reported once by take_replaced)."""
        if self.procs is None:
            return
        for slot in self.procs.poll():
            exits = self.procs.slots[slot].exits
            self._replace(slot, f"process exited with {exits[-1]}")
            if len(exits) > MAX_RESTARTS:
                raise RuntimeError(f"worker slot {slot} exited {len(exits)} times (last exit code "
                                   f"{exits[-1]}); see {self.procs.log_dir / f'slot{slot}.log'}")
            self.procs.start(slot)

    def take_replaced(self) -> list[int]:
        out, self._replaced = self._replaced, []
        return out

    def ready_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.ready and not self.need_group]

    def _on_control(self, meta: dict[str, Any]) -> None:
        slot, op = meta.get("slot"), meta.get("op")
        if not isinstance(slot, int) or not 0 <= slot < self.n or meta.get("session") != self.session:
            self.counts["control_foreign"] += 1
            return
        st = self.slots[slot]
        if op == "hello":
            pid = meta.get("pid")
            if st.pid is not None and pid != st.pid:
                self._replace(slot, f"hello from new pid {pid} (was {st.pid})")
                st = self.slots[slot]
            st.pid = pid
            st.deltas = meta.get("deltas") is True
            self._connect(slot, meta.get("endpoint"))
            gen = meta.get("gen", -1)
            st.gen_seen = gen if isinstance(gen, int) else -1
            # A hello naming the current generation means the worker left (or failed to join) the
            # current group; an older one was sent before our invitation reached it: ignore it.
            if self.gen > 0 and st.gen_seen >= self.gen:
                st.ready = False
                self.need_group = True
        elif op == "synced":
            self.sync_acks.append(meta)
            if meta.get("verified") == 1.0:  # forgives an earlier mismatch
                self.resync.decide(slot, OK)
        elif op == "resync":  # the worker holds weights a delta cannot build on: send all
            reason = meta.get("reason")
            decision = self.resync.decide(
                slot, reason if reason in RESYNC_REASONS else OTHER,
                version=meta.get("version", -1), bad=meta.get("bad"),
                who=f"worker slot {slot} ({meta.get('engine', 'engine')})")
            self.counts[f"resync/{decision.reason}"] += 1
            self.need_full, self._holder = True, None
            if decision.error is not None and self.halted is None:  # a full resync failed too
                self.halted = decision.error
        elif op == "redone":  # a generation abandoned at a failed sync, queued again
            n = meta.get("prompts")
            self.counts["unverified_redone"] += n if isinstance(n, int) and n > 0 else 0
        else:
            self.counts["control_unknown"] += 1

    def _connect(self, slot: int, endpoint: Any) -> None:
        from qurl.pipeline.channel import Sender

        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            self.counts["hello_bad_endpoint"] += 1
            return
        old = self.senders[slot]
        if old is not None and old.endpoint == endpoint:
            return
        if old is not None:
            old.close(linger_ms=0)
        self.senders[slot] = Sender(endpoint, self.key, bind=False, name=f"controller-slot{slot}",
                                    hwm=self.stream.hwm, linger_ms=0)

    def poll(self, timeout_ms: int = 0) -> list[Any]:
        """Receive for up to timeout_ms; handle control messages, return trajectory messages."""
        now = time.monotonic()
        if now - self._last_ping > PING_EVERY_S:
            self._last_ping = now
            for i in self.ready_slots():
                self.send_control(i, {"op": "ping"})
        out = []
        for msg in self.inbox.recv_many(10_000, timeout_ms=timeout_ms):
            if msg.kind == "control":
                self._on_control(msg.meta)
            elif msg.meta.get("session") != self.session:
                self.counts["traj_foreign"] += 1
            else:
                out.append(msg)
        return out

    def send_control(self, slot: int, meta: dict[str, Any], timeout_ms: int = 10_000) -> bool:
        if self.senders[slot] is None:
            return False
        ok = self.senders[slot].send("control", {"session": self.session, **meta},
                                     timeout_ms=timeout_ms)
        if not ok:
            self.counts["control_not_sent"] += 1
        return ok

    def send_prompt(self, slot: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        if self.senders[slot] is None:
            return False
        return self.senders[slot].send("prompt", {"session": self.session, **meta}, tensors,
                                       timeout_ms=10_000)

    # ------------------------------------------------------------------ weight group

    def _wait_for_hellos(self, on_traj: Any) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while any(s is None for s in self.senders):
            if time.monotonic() > deadline:
                missing = [i for i, s in enumerate(self.senders) if s is None]
                raise RuntimeError(f"worker slots {missing} did not say hello within "
                                   f"{JOIN_TIMEOUT_S}s; see {self.run_dir / 'workers'}")
            self.check_procs()
            for msg in self.poll(200):
                on_traj(msg)

    @property
    def gen(self) -> int:
        """The weight group's generation (0 before the first one formed)."""
        return self.weights.gen

    def _form_group(self) -> None:
        def invite(spec: GroupSpec) -> Callable[[], None]:
            msg = {"op": "group", "gen": spec.gen, "host": spec.host, "port": spec.port,
                   "world": spec.world, "backend": spec.backend, "name": spec.name,
                   "timeout_s": GROUP_TIMEOUT_S}
            for i in range(self.n):
                if not self.send_control(i, {**msg, "rank": i + 1}):
                    raise RuntimeError(f"could not invite worker slot {i} to the weight group")
            return lambda: None  # workers answer through their acks, not here

        self._close_group()
        self._holder = None  # new members (or a restarted one) hold who knows what
        self.weights.form(self.n + 1, invite)
        self.counts["groups_formed"] += 1

    def _close_group(self) -> None:
        self.weights.close()
        for s in self.slots:
            s.ready = False

    def can_delta(self) -> bool:
        """Every slot's engine can apply deltas (from the workers' hellos)."""
        return all(s.deltas for s in self.slots)

    def plan(self, chunks: list[tuple[str, torch.Tensor]], version: int) -> SyncPlan:
        """What to broadcast for `version`: a delta against the version every member holds,
        when each member's engine can take one (module docstring), else the whole version."""
        holder = None if self.need_full else self._holder
        return self.planner.plan(chunks, version, holder, can_delta=self.can_delta())

    def broadcast(self, chunks: list[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Send one version to every worker in the current group, as a delta when every member
        holds the previous one (module docstring). Raises on a failed broadcast (the group is
        then closed and need_group set)."""
        plan = self.plan(chunks, version)
        header = plan.header()

        def announce(ann: Any) -> None:
            meta = {"op": "weights", **ann.to_dict()}
            if ann.index == 0:
                meta["sync"] = header
            for i in range(self.n):
                if not self.send_control(i, meta):
                    raise RuntimeError(f"weight announcement to slot {i} not sent")

        wire = broadcast_chunks(plan, chunks)
        self._holder = None  # until every member has it
        try:
            stats = self.weights.send(iter(wire), version, announce=announce)
        except Exception:
            self.need_group = True
            self._close_group()
            raise
        self._holder, self.need_full = (version, plan.digest), False
        for s in self.slots:
            s.ready = True
        return {**stats.metrics(), **plan.metrics(), **self.planner.metrics()}

    def push(self, chunks: list[tuple[str, torch.Tensor]], version: int, on_traj: Any,
             max_attempts: int = 5) -> dict[str, float]:
        """Make every worker hold `version`: broadcast in the current group, or (re)form the group
        first when membership changed. `on_traj` receives trajectory messages that arrive while
        waiting. Returns the sync metrics of the successful broadcast."""
        for attempt in range(max_attempts):
            self.check_procs()
            try:
                if self.need_group:
                    self._wait_for_hellos(on_traj)
                    self._form_group()
                    self.need_group = False
                return self.broadcast(chunks, version)
            except Exception as e:  # a worker died or hung mid-sync: restart it, re-form, resend
                if isinstance(e, GroupFormError) and isinstance(e.__cause__, GroupAddressError):
                    raise InputError(str(e)) from None  # addresses that cannot meet: no retry
                log.warning("weight push v%d attempt %d failed: %s", version, attempt + 1, e)
                self.counts["push_failures"] += 1
                self.need_group = True
                self._close_group()
                time.sleep(0.5)
        raise RuntimeError(f"could not push weights v{version} to the workers in {max_attempts} "
                           f"attempts; see {self.run_dir / 'workers'}")

    def rejects(self) -> dict[str, int]:
        return dict(self.inbox.rejects)

    def close(self) -> None:
        for i in range(self.n):
            if self.slots[i].pid is not None:
                self.send_control(i, {"op": "stop"}, timeout_ms=100)
        if self.procs is not None:
            self.procs.close()
        self._close_group()
        for s in self.senders:
            if s is not None:
                s.close(linger_ms=0)
        self.inbox.close()
