"""A small pool of persistent worker processes that run `compare(pred, gold)` with a hard deadline.

One job is one comparison. The parent hands each ready, idle worker one job over a pipe and waits
(`multiprocessing.connection.wait`) for answers or for the earliest deadline. A worker that misses its
job's deadline is SIGKILLed and replaced at once (the replacement imports in the background while the
other workers carry on); its job is reported as timed out. A worker that dies mid-job is replaced and
its job reported as an error. Deadlines start when a job reaches a *ready* worker, so the one-off
import cost of a fresh worker never counts against a comparison.

Workers are plain `python -c` subprocesses talking over a socketpair wrapped in
multiprocessing `Connection`s, not multiprocessing.Process: "fork" can deadlock a trainer holding
torch thread pools or ZeroMQ sockets, and "spawn"/"forkserver" re-import the parent's `__main__`, which
breaks unguarded scripts and notebooks. The child gets the parent's sys.path (PYTHONPATH), so a
module-level `compare` from anywhere the parent can import unpickles there. Workers ignore SIGINT
(Ctrl-C reaches only the parent, which owns their shutdown), exit on EOF when the parent closes its
end, and exit on their own if the parent dies without closing it. The pool stops its workers when
closed, when garbage-collected and at interpreter exit.

Not thread-safe by itself: the owner (rewards.RewardFn) serialises calls to `run` and `close`.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

__all__ = ["Outcome", "WorkerPool"]

_READY = "ready"


@dataclass(frozen=True)
class Outcome:
    value: bool
    timed_out: bool
    error: str | None


def _exit_when_orphaned(poll_s: float = 1.0) -> None:
    """Watchdog thread: end this worker if its parent dies without closing the pipe (e.g. SIGKILL).
    (PR_SET_PDEATHSIG would fire when the *thread* that started the worker exits, which a pool
    created from a short-lived thread would hit, so the parent pid is polled instead.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="qurl-reward-watchdog").start()


def _worker_main(fd: int) -> None:
    """Entry point of a worker subprocess; fd is its end of the socketpair."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_orphaned()
    conn = Connection(fd)
    compare, warmup = pickle.loads(conn.recv_bytes())
    if warmup is not None:
        warmup()
    conn.send(_READY)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # parent went away
        if msg is None:
            return
        job, pred, gold = msg
        try:
            conn.send((job, bool(compare(pred, gold)), None))
        except Exception as e:  # a verifier crash is reported, not fatal
            conn.send((job, False, f"{type(e).__name__}: {e}"[:500]))


class _Worker:
    def __init__(self, payload: bytes) -> None:
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        # The child sees what the parent can import (tests, editable installs, sys.path edits).
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from qurl.data._reward_pool import _worker_main; _worker_main({theirs.fileno()})"],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()  # the parent keeps only its end, so a dead worker reads as EOF
        self.conn = Connection(mine.detach())
        self.conn.send_bytes(payload)
        self.ready = False
        self.started = time.monotonic()
        self.job: int | None = None
        self.deadline = 0.0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass  # unkillable (uninterruptible sleep): nothing more we can do; it is reaped later
        self.conn.close()

    def stop(self) -> None:
        """Ask politely, then kill: used at shutdown."""
        try:
            if self.alive() and self.job is None:
                self.conn.send(None)
                self.proc.wait(timeout=1)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


def _close_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop()
    workers.clear()


class WorkerPool:
    """`size` workers running `compare`; `run(jobs, timeout_s)` -> one Outcome per job, in order."""

    def __init__(
        self,
        size: int,
        compare: Callable[[str, str], bool],
        *,
        warmup: Callable[[], object] | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        self._size = size
        try:
            self._payload = pickle.dumps((compare, warmup))
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(f"reward compare/warmup must be picklable module-level functions: {e}") from None
        self._startup_timeout_s = startup_timeout_s
        self._workers: list[_Worker] = []
        self.respawns = 0
        # Stops the workers when the pool is garbage-collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _close_all, self._workers)

    def _spawn(self) -> _Worker:
        return _Worker(self._payload)

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = self._spawn()
        self.respawns += 1

    def run(self, jobs: Sequence[tuple[str, str]], timeout_s: float) -> list[Outcome]:
        while len(self._workers) < self._size:
            self._workers.append(self._spawn())
        out: list[Outcome | None] = [None] * len(jobs)
        queue = deque(range(len(jobs)))
        while queue or any(w.job is not None for w in self._workers):
            now = time.monotonic()
            for slot, w in enumerate(self._workers):
                if not (queue and w.ready and w.job is None):
                    continue
                if not w.alive():  # died while idle: replace before handing it work
                    self._replace(slot)
                    continue
                job = queue.popleft()
                try:
                    w.conn.send((job, *jobs[job]))
                except OSError:
                    queue.appendleft(job)
                    self._replace(slot)
                    continue
                w.job, w.deadline = job, now + timeout_s
            watched = [w for w in self._workers if w.job is not None or not w.ready]
            wake = min(
                (w.deadline if w.job is not None else w.started + self._startup_timeout_s) for w in watched
            )
            readable = set(wait([w.conn for w in watched], timeout=max(0.0, wake - time.monotonic())))
            for slot, w in enumerate(self._workers):
                if w.conn not in readable:
                    continue
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    try:  # EOF can arrive a moment before the exit status: wait for it briefly
                        code = w.proc.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        code = None
                    if w.job is None:
                        raise RuntimeError(f"reward worker exited during startup (exit code {code})") from None
                    out[w.job] = Outcome(False, False, f"reward worker died (exit code {code})")
                    self._replace(slot)
                    continue
                if msg == _READY:
                    w.ready = True
                    continue
                job, value, error = msg
                out[job] = Outcome(value, False, error)
                w.job = None
            now = time.monotonic()
            for slot, w in enumerate(self._workers):
                if w.job is not None and now >= w.deadline:
                    out[w.job] = Outcome(False, True, None)
                    self._replace(slot)
                elif not w.ready and now >= w.started + self._startup_timeout_s:
                    raise RuntimeError(f"reward worker not ready after {self._startup_timeout_s:.0f} s")
        return out  # type: ignore[return-value]

    def close(self) -> None:
        _close_all(self._workers)
