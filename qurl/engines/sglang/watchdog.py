"""The progress watchdog: a server whose requests stop moving is found within `stall_s`.

Why not a ping. SGLang's HTTP process (the tokenizer manager) answers `/model_info` by itself, so
it says 200 while the scheduler behind it is stuck: SIGSTOPped, a hung kernel, an NCCL stream
waiting for a peer that died. A /generate call to such a server waits its full timeout
(`Timeouts.generate_s`, 1,800 s), and so does the whole rollout behind it.

What is probed instead: `GET /health_generate` (sglang 0.5.23 `srt/entrypoints/http_server.py`
`health_generate`, lines 721-799). It submits a one-token request and answers 200 as soon as
the tokenizer manager has received ANY output from the scheduler since the probe began
(`last_receive_tstamp > tic`, line 781; the stamp is set for every message from the scheduler in
`TokenizerManager.handle_loop`, `srt/managers/tokenizer_manager.py` lines 2465-2478), else 503
after SGLANG_HEALTH_CHECK_TIMEOUT seconds (line 218, 20 by default). A busy scheduler sends the
output of every running non-streaming request each 50 tokens (SGLANG_FORCE_STREAM_INTERVAL,
`srt/managers/scheduler_components/output_streamer.py` lines 474-477) and finishes the probe's
own token when it has room, so a 200 means: this server's requests moved after the probe began.
`/health` is the same handler (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is on by default).

The bound. While a server has requests in flight, its probes run back to back (each at most
`stall_s`, at least `PROBE_GAP_S` apart). The server's last progress is the start of its last
probe that answered 200, the end of its last /generate call that answered, or the moment it
turned busy. A server paused by a weight update makes no progress by design (its probes wait,
then 503), so while the engine holds generation every server's clock restarts. When a busy
server's last progress is more than `stall_s` old it is stalled: it gets no new requests, and its
in-flight HTTP calls are cut (their sockets shut down, so the blocked threads return at once,
`Server.abort_calls`). The engine then restarts it when qurl launched it, or drops it from
routing when it was attached (SGLangEngine._recover), and the cut requests are resubmitted as
prompt + the prefix they had before this call (the partial-rollout path of pauses). Detection
takes at most stall_s + one probe; each stall is counted (`SGLangEngine.stats`, rollout/stalls).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

from qurl.engines.sglang.launcher import Server
from qurl.engines.sglang.protocol import SGLangError, SGLangUnavailable

PROBE_ROUTE = "/health_generate"
PROBE_GAP_S = 1.0  # between the starts of two probes of one server (SGLang's own first check is
# one second after the probe starts, http_server.py line 780)


class Watchdog:
    """One thread that watches every busy server's progress; see the module docstring.

    `servers()`: the engine's current servers (they change when one is dropped); `held()`: the
    engine holds generation (a weight update); `on_stall(server)`: called once per stall, after
    the server's calls were cut (the engine counts it and wakes its routing)."""

    def __init__(self, stall_s: float, servers: Callable[[], list[Server]],
                 held: Callable[[], bool], on_stall: Callable[[Server], None]) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s={stall_s}: must be > 0")
        self.stall_s, self.tick_s = stall_s, min(1.0, stall_s / 8)
        self._servers, self._held, self._on_stall = servers, held, on_stall
        self._probing: set[int] = set()  # id() of servers with a probe in flight
        self._stop = threading.Event()
        for s in servers():
            s.progress_at = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="sglang-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            held = self._held()
            for s in list(self._servers()):
                if held or s.inflight == 0:
                    s.progress_at = now  # paused or idle: nothing is expected of it
                    continue
                if s.stalled is not None:
                    s.abort_calls()  # a call that connected after the cut: cut it too
                    continue
                if now - s.progress_at > self.stall_s:
                    s.stalled = (f"server {s.spec.url} made no progress for {self.stall_s:g}s "
                                 f"with {s.inflight} requests in flight (GET {PROBE_ROUTE} got no "
                                 f"output from its scheduler)")
                    s.abort_calls()
                    self._on_stall(s)
                elif id(s) not in self._probing:
                    self._probing.add(id(s))
                    threading.Thread(target=self._probe, args=(s,), daemon=True,
                                     name=f"sglang-probe-{s.port}").start()

    def _probe(self, s: Server) -> None:
        """Probes back to back while `s` is busy, and moves its progress clock on each 200."""
        try:
            while not self._stop.is_set() and s.inflight > 0 and s.stalled is None:
                tic = time.monotonic()
                try:
                    ok = s.call("GET", PROBE_ROUTE, None, self.stall_s)[0] == 200
                except SGLangUnavailable:
                    ok = False
                if ok:
                    s.progress_at = max(s.progress_at, tic)
                self._stop.wait(max(0.0, PROBE_GAP_S - (time.monotonic() - tic)))
        finally:
            self._probing.discard(id(s))


class _Engine(Protocol):
    servers: list[Server]
    dropped: list[str]
    stalls: int
    restarts: int
    _pick_lock: threading.Condition


class StallHandling:
    """What SGLangEngine does about a stall (mixed into it): count it, wake the routing, and
    sort the dead servers of a recovery into those to restart and those to drop."""

    def stats(self: _Engine) -> dict[str, float]:
        """Counters since the engine started: servers found stalled, restarted, dropped."""
        return {"rollout/stalls": self.stalls, "rollout/restarts": self.restarts,
                "rollout/dropped": len(self.dropped)}

    def _stalled(self: _Engine, server: Server) -> None:
        """The watchdog found `server` stalled and cut its calls: count it, and wake the routing
        (a request waiting for room there goes elsewhere, or recovers it: SGLangEngine._run)."""
        with self._pick_lock:
            self.stalls += 1
            self._pick_lock.notify_all()

    def _drop_attached(self: _Engine, dead: list[Server], cause: Exception) -> list[Server]:
        """Drop the attached servers among `dead` (qurl cannot restart them) from routing and
        return the rest, to restart; when that would leave no server, a one-line error."""
        for s in [s for s in dead if s.spec.command is None]:
            why = s.stalled or f"server {s.spec.url} stopped answering"
            if len(self.servers) == 1:
                raise SGLangError(f"{why}; it was attached, not launched by qurl, so it cannot be "
                                  "restarted, and no other server is left: check its scheduler "
                                  f"process, GPU and log ({cause})")
            dead.remove(s)
            with self._pick_lock:
                self.servers.remove(s)
            self.dropped.append(s.spec.url)
            s.abort_calls()
        return dead
