"""Start, watch and restart the rollout worker processes of one run.

Each worker slot i runs `python -m qurl.pipeline.worker --run-dir <run> --slot i --parent-pid <pid>`
as a child process of the controller, with stdout/stderr appended to `<run>/workers/slot<i>.log`
and its pid in `<run>/workers/slot<i>.pid`.
The worker exits by itself when the parent pid disappears (a SIGKILLed controller leaves no orphans
generating into the void); a resumed controller starts fresh workers, which find the new endpoints
in the run directory.

Invariants:
- `poll()` reports each unexpected exit exactly once (a slot we stopped on purpose is not reported).
- `restart(slot)` replaces the process of that slot; its incarnation counter increases, so log lines
  and hellos of the old and new process can be told apart.
- `close()` ends every child it started (SIGTERM, then SIGKILL after a grace period) and nothing else.
  The grace covers what a worker does on SIGTERM: an SGLang-backed worker stops its server (which
  runs in its own session and would outlive a SIGKILLed worker), so the fleet gives it that long.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class _Slot:
    proc: subprocess.Popen | None = None
    incarnation: int = 0
    restarts: int = 0
    exits: list[int] = field(default_factory=list)


class WorkerProcs:
    """The worker processes of a run, one per slot (module docstring)."""

    def __init__(self, run_dir: str | Path, num_workers: int, *, threads: int = 0,
                 python: str = sys.executable, extra_env: dict[str, str] | None = None,
                 grace_s: float = 5.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: must be >= 1")
        self.run_dir = Path(run_dir)
        self.num_workers = num_workers
        self.threads = threads
        self.python = python
        self.extra_env = dict(extra_env or {})
        self.grace_s = grace_s  # SIGTERM -> SIGKILL: long enough for a worker to stop its server
        self.slots = [_Slot() for _ in range(num_workers)]
        self.log_dir = self.run_dir / "workers"

    def _command(self, slot: int) -> list[str]:
        cmd = [self.python, "-m", "qurl.pipeline.worker", "--run-dir", str(self.run_dir),
               "--slot", str(slot), "--parent-pid", str(os.getpid())]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        return cmd

    def start(self, slot: int) -> int:
        """Start the process of `slot` (which must not be running). Returns its pid."""
        s = self.slots[slot]
        if s.proc is not None and s.proc.poll() is None:
            raise RuntimeError(f"worker slot {slot} is already running (pid {s.proc.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        # The child must import this very qurl, whatever the caller's cwd.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH"))
                                            if p)
        env.update(self.extra_env)
        log = (self.log_dir / f"slot{slot}.log").open("ab")
        try:
            s.proc = subprocess.Popen(self._command(slot), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, cwd=os.getcwd())
        finally:
            log.close()  # the child holds its own descriptor
        (self.log_dir / f"slot{slot}.pid").write_text(f"{s.proc.pid}\n")
        s.incarnation += 1
        return s.proc.pid

    def start_all(self) -> None:
        for slot in range(self.num_workers):
            self.start(slot)

    def pid(self, slot: int) -> int | None:
        p = self.slots[slot].proc
        return p.pid if p is not None else None

    def alive(self, slot: int) -> bool:
        p = self.slots[slot].proc
        return p is not None and p.poll() is None

    def poll(self) -> list[int]:
        """Slots whose process has exited since the last poll (each exit reported once)."""
        dead = []
        for i, s in enumerate(self.slots):
            if s.proc is not None and s.proc.poll() is not None:
                s.exits.append(s.proc.returncode)
                s.proc = None
                dead.append(i)
        return dead

    def restart(self, slot: int) -> int:
        """Replace the process of `slot` (stopping it first if it still runs). Returns the new pid."""
        self.stop(slot)
        self.slots[slot].restarts += 1
        return self.start(slot)

    def stop(self, slot: int) -> None:
        s = self.slots[slot]
        if s.proc is None:
            return
        if s.proc.poll() is None:
            s.proc.terminate()
            try:
                s.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
        s.proc = None

    def close(self) -> None:
        """Stop every worker: SIGTERM all, wait up to grace_s together, SIGKILL the rest."""
        procs = [s.proc for s in self.slots if s.proc is not None and s.proc.poll() is None]
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + self.grace_s
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s in self.slots:
            s.proc = None

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.slots)
