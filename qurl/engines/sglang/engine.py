"""SGLang rollout engines over HTTP: one `SGLangEngine` drives N servers as one Engine.

The Engine protocol is qurl/types.py. Requests are spread over the servers (least in
flight). Each sync (`load_weights`) pauses every server (abort mode), opens the update session,
broadcasts the chunks bucket by bucket (qurl/weights/broadcaster.py, the routine the async controller
uses too) to the weight group (learner rank 0 + every server rank) while one HTTP call per server
per bucket is in flight, closes the session, flushes caches and continues. Requests interrupted by
the pause come back with their partial output; they are resubmitted as prompt + generated prefix
with the remaining token budget, and the pieces are stitched with per-token versions (partial
rollout). A server that refuses a bucket (HTTP 400 before joining its broadcast) is reported while
the broadcast is in flight, not after the group timeout (qurl/weights/sender.py). Before use, each
server's /server_info must agree with what qurl was told (TP size; the W8A8 restore loader); it
also tells whether the servers run qurl's sync loader, which makes deltas and verification
possible (verified_sync.py, qurl/engines/sglang/inside/apply.py).
Servers qurl launches get GPUs of their own after the learner's (`--base-gpu-id`,
qurl/node/placement.py); the weight group's backend is sglang.backend. A server that stops
answering is restarted (when qurl launched it), the weight group is formed anew, and the current
weights are sent again (so the engine keeps the last synced chunks in CPU memory: the size of the
8-bit model). Every HTTP call has a timeout; a malformed reply is an SGLangError naming the server,
route and what is wrong. A server whose requests stop moving is found within `Timeouts.stall_s`
(watchdog.py), its calls cut, and it is restarted or dropped. Limits: syncs
are not watched: with NCCL, servers that survive a peer dying in the middle of a broadcast stay
blocked in it until SGLang's group timeout (30 min by default); gloo reports it at once.

Concurrency is per server: each gets as many requests at once as it runs itself (its /server_info
`internal_states[*].effective_max_running_requests_per_dp`, summed over DP ranks, or its
`--max-running-requests`; protocol.py `running_limit`), or `max_running` when the config sets
sglang.max_running, or UNREPORTED_RUNNING when the server reports neither. More would only wait
in the server's queue (and be aborted by the next sync's pause); fewer leaves it idle.

The protocol facts this relies on are protocol.py; one server process is
launcher.py; the weight group and update sessions are update.py (`WeightUpdates`, which this
class extends); from_config.py makes one from a run's `sglang` section; this module starts the
servers, routes and resumes requests, recovers servers.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from qurl.config import ConfigError
from qurl.engines.sglang.inside.tp_cut import Layout
from qurl.engines.sglang.launcher import Server, ServerSpec, stop_all
from qurl.engines.sglang.protocol import (QUANTIZATION, RESTORE_QUANTIZATIONS, SGLangError,
                                          SGLangUnavailable, parse_generate, parse_routes,
                                          topk_entropy)
from qurl.engines.sglang.update import WeightUpdates
from qurl.engines.sglang.watchdog import StallHandling, Watchdog
from qurl.types import GenRequest, GenResult
from qurl.weights.broadcaster import Broadcaster
from qurl.weights.sender import SyncStats


UNREPORTED_RUNNING = 256  # requests at once to a server whose /server_info reports no cap


@dataclass
class Timeouts:
    control_s: float = 60.0  # pause, continue, flush, begin/end, version
    generate_s: float = 1800.0  # one /generate call (long reasoning rollouts)
    group_s: float = 600.0  # forming the group; one bucket's broadcast + load
    launch_s: float = 900.0  # process start until /health answers 200
    health_s: float = 10.0  # one /health probe
    stall_s: float = 120.0  # a busy server without progress this long is stalled; 0 = no watchdog


@dataclass
class _Pending:
    """One request being generated, possibly over several /generate calls."""

    req: GenRequest
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # [rows, L, k] per reply, in order
    route_rows: int = 0  # positions routed so far: the next call's routed_experts_start_len
    calls: int = 0


class SGLangEngine(StallHandling, WeightUpdates):
    """Engine (qurl/types.py) over SGLang servers; see the module docstring."""

    def __init__(self, servers: list[ServerSpec], *, precision: str = "int8",
                 group_host: str = "127.0.0.1", group_port: int = 0, backend: str = "auto",
                 bucket_bytes: int = 64 << 20, load_format: str = "flattened_bucket",
                 timeouts: Timeouts | None = None, log_dir: str | Path | None = None,
                 max_restarts: int = 3, poll_s: float = 0.05, keep_weights: bool = True,
                 tokenizer: Any = None, vocab_size: int = 0, ready_probe: str = "/health",
                 layout: Layout | None = None, max_running: int = 0, top_logprobs: int = 0,
                 routes: tuple[int, int, int] | None = None) -> None:
        """`tokenizer` / `vocab_size`: the served model's (the loops encode prompts with it and
        validate token ids against it); from_config.py reads both from the model directory.
        `ready_probe`: what a (re)started server must answer 200 before use: "/health" (a real
        one-token generation) or "/model_info" (model loaded; for servers that cannot generate,
        such as 8-bit SGLang on a CPU). `layout`: the model's head counts, which map a TP > 1
        server's cut for delta and verified syncs (qurl/engines/sglang/inside/tp_cut.py; without it,
        read from the config.json of the model path the server reports, when readable here).
        `max_running`: requests sent to each server at once; 0 = what the server reports it runs
        (module docstring). `top_logprobs`: k > 0 asks for the top k at every token and gives
        each result its entropy bound (protocol.py `topk_entropy`). `routes`: (L, k, E) of a
        mixture of experts whose routes the run needs (algo.routing_replay=rollout, or
        sglang.return_routes to measure the flips without replay): every request
        asks for them and each result carries `routed_experts` (the servers must run with
        `--enable-return-routed-experts`; from_config.py adds it to the ones it launches)."""
        if not servers:
            raise ValueError("SGLangEngine needs at least one server")
        if precision not in QUANTIZATION:
            raise ValueError(f"precision={precision!r}: must be one of {', '.join(QUANTIZATION)}")
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={backend!r}: must be auto, nccl or gloo")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("sglang.backend=nccl: this process has no CUDA device to join the "
                             "weight group from; use sglang.backend=gloo (or auto)")
        self.precision, self.layout = precision, layout
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.timeouts = timeouts or Timeouts()
        # the weight group: this process is rank 0, every TP rank of every server a peer
        self.weights = Broadcaster(group_host, group_port, backend, name="qurl_weights",
                                   bucket_bytes=bucket_bytes, load_format=load_format,
                                   timeout_s=self.timeouts.group_s)
        self.max_restarts, self.poll_s, self.keep_weights = max_restarts, poll_s, keep_weights
        log = Path(log_dir) if log_dir else None
        if log:
            log.mkdir(parents=True, exist_ok=True)
        self.servers = [Server(s, log, ready_probe) for s in servers]
        if max_running < 0:
            raise ValueError(f"max_running={max_running}: must be >= 0 (0 = the server's own)")
        self.max_running, self.top_logprobs, self.routes = max_running, top_logprobs, routes
        self._lock = threading.RLock()  # syncs and recoveries, one at a time
        self._pick_lock = threading.Condition()  # request routing counters only
        self._resume = threading.Event()  # cleared while weights change: no new submissions
        self._resume.set()
        self._holds = 0
        self._pauses = 0  # bumped by every pause: tells an aborted request it was interrupted
        self._recoveries = 0
        self._version = 0
        self._weights: list[tuple[str, torch.Tensor]] | None = None  # last synced chunks
        self._disk: str | None = None  # or: last update_weights_from_disk path
        self.restarts = self.stalls = 0  # stalls: found by the watchdog (`stats`)
        self.dropped: list[str] = []  # attached servers dropped from routing (stalled or dead)
        self._watchdog: Watchdog | None = None
        self.last_sync: SyncStats | None = None
        self._group_name: str | None = None  # the servers' current weight group
        try:
            for s in self.servers:
                if s.spec.command is not None:
                    s.launch()
            for s in self.servers:
                s.wait_healthy(self.timeouts.launch_s, self.timeouts.health_s)
            self._each(self._check_server, self.timeouts.control_s * 2)
            self._set_limits()
            self._set_version_all(0)
            self._form_group()
            if self.timeouts.stall_s > 0:
                self._watchdog = Watchdog(self.timeouts.stall_s, lambda: self.servers,
                                          lambda: not self._resume.is_set(), self._stalled)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- construction helpers
    @property
    def version(self) -> int:
        return self._version

    def _set_limits(self) -> None:
        """Each server's share of requests at once (module docstring); after every /server_info."""
        with self._pick_lock:
            for s in self.servers:
                s.max_running = self.max_running or s.reported_running or UNREPORTED_RUNNING
            self._pick_lock.notify_all()

    def sync_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The kept copy of the last version and the sender's staging buffers
        (qurl/weights/host.py `sync_memory`; the arenas are the WeightSync's)."""
        sender = self.weights.sender
        kept = list(self._kept.values()) if self._kept is not None else \
            [t for _, t in self._weights or []]
        return {"kept": kept, **(sender.sync_tensors() if sender is not None else {})}

    @property
    def capacity(self) -> int:
        """Requests the engine keeps in flight at once over all its servers."""
        return sum(s.max_running for s in self.servers)

    @contextmanager
    def _hold(self) -> Iterator[None]:
        """Keep requests from being (re)submitted while weights change (nests)."""
        with self._lock:
            self._holds += 1
            self._resume.clear()
            try:
                yield
            finally:
                self._holds -= 1
                if self._holds == 0:
                    self._resume.set()

    def _each(self, fn: Callable[[Server], Any], timeout: float) -> list[Any]:
        """Run fn on every server concurrently (they are independent processes)."""
        with ThreadPoolExecutor(max_workers=len(self.servers)) as ex:
            futs = [ex.submit(fn, s) for s in self.servers]
            return [f.result(timeout=timeout) for f in futs]



    # ---------------------------------------------------------------- recovery
    def _recover(self, cause: Exception, resend: bool = True) -> None:
        """Restart every server that does not answer, form a new group, resend the weights.

        Dead means the process does not answer /model_info (or has exited): a server paused by a
        sync that failed half-way is alive, and must not be judged by /health, which waits
        behind the pause (see `Server.healthy`). A stalled one (the watchdog's) is dead too. An
        attached dead server is dropped, or, the last one, a one-line error."""
        with self._hold():
            self._recoveries += 1
            self._digest = None  # a restarted server holds its checkpoint until resent: unverified
            dead = self._drop_attached([s for s in self.servers
                                        if s.stalled or not s.alive(self.timeouts.health_s)], cause)
            if dead and self.restarts + len(dead) > self.max_restarts * len(self.servers):
                raise SGLangError(f"giving up after {self.restarts} restarts; last error: {cause}")
            for s in dead:
                s.launch()
                self.restarts += 1
            for s in dead:
                s.wait_healthy(self.timeouts.launch_s, self.timeouts.health_s)
            self._leave_group(self.timeouts.control_s)  # ends a broadcast a failed sync left
            w8a8 = QUANTIZATION[self.precision][0] in RESTORE_QUANTIZATIONS
            for s in self.servers:  # a sync may have died inside a session: close it
                try:  # restore first (idempotent), or closing would repack W8A8 layers twice
                    if w8a8:
                        self._restore_w8a8(s)
                except SGLangError:
                    pass  # no session open: nothing to close
                try:
                    s.post_json("/end_weight_update", {}, self.timeouts.control_s, ok_404=True)
                except SGLangError:
                    pass
                try:
                    s.post_json("/continue_generation", {}, self.timeouts.control_s)
                except SGLangError:
                    pass
            self._each(self._check_server, self.timeouts.control_s * 2)  # restarted: limits anew
            self._set_limits()
            self._form_group()
            self._set_version_all(self._version)
            if resend and self._weights is not None:  # (with qurl's header: a qurl sync)
                self.last_sync = self._sync(self._wire(self._weights, self._version, None),
                                            self._version)
            elif resend and self._disk is not None:
                self.update_weights_from_disk(self._disk, self._version)

    # ---------------------------------------------------------------- generation
    def generate(self, requests: list[GenRequest],
                 between_steps: Callable[[], None] | None = None) -> list[GenResult]:
        """Sample every request to completion on the servers. `between_steps` is called every
        `poll_s` while requests run; a `load_weights` from it interrupts and resumes them."""
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(len(requests), self.capacity)) as ex:
            futs = [ex.submit(self._run, r) for r in requests]
            while not all(f.done() for f in futs):
                time.sleep(self.poll_s)
                if between_steps is not None:
                    between_steps()
            return [f.result() for f in futs]

    def _pick(self) -> Server | None:
        """The server with the most free room; waits while every server runs its max_running.
        Stalled servers get nothing; None when every server is stalled (recover first)."""
        with self._pick_lock:
            while True:
                ok = [x for x in self.servers if x.stalled is None]
                if not ok:
                    return None
                s = max(ok, key=lambda x: x.max_running - x.inflight)
                if s.inflight < s.max_running:
                    if s.inflight == 0:  # turns busy: the watchdog's clock starts now
                        s.progress_at = time.monotonic()
                    s.inflight += 1
                    return s
                self._pick_lock.wait()

    def _run(self, req: GenRequest) -> GenResult:
        p = _Pending(req)
        budget = req.params.max_new_tokens
        finish = "length"
        while len(p.ids) < budget:
            self._resume.wait()
            pauses, recoveries = self._pauses, self._recoveries
            server = self._pick() if not any(s.stalled for s in self.servers) else None
            if server is None:  # the watchdog found a server stalled: restart or drop it
                with self._lock:
                    if self._recoveries == recoveries:
                        self._recover(SGLangUnavailable("; ".join(
                            s.stalled for s in self.servers if s.stalled)))
                continue
            sp = {"max_new_tokens": budget - len(p.ids), "temperature": req.params.temperature,
                  "top_p": req.params.top_p}
            if req.params.seed is not None:
                sp["sampling_seed"] = req.params.seed
            if req.params.stop_token_ids:
                sp["stop_token_ids"] = list(req.params.stop_token_ids)
            body = {"rid": f"{req.rid}#{p.calls}", "input_ids": list(req.prompt_ids) + p.ids,
                    "sampling_params": sp, "return_logprob": True, "stream": False}
            if self.top_logprobs:
                body["top_logprobs_num"] = self.top_logprobs
            if self.routes is not None:  # resumed: only the positions not routed yet
                body["return_routed_experts"] = True
                body["routed_experts_start_len"] = p.route_rows
            p.calls += 1
            where = f"POST /generate on {server.spec.url} (request {req.rid})"
            try:
                status, raw = server.call("POST", "/generate", body, self.timeouts.generate_s)
            except SGLangUnavailable as e:
                if p.calls > 2 * self.max_restarts + 2:
                    raise
                with self._lock:
                    if self._recoveries == recoveries:  # nobody has recovered since we sent it
                        self._recover(e)
                continue
            finally:
                with self._pick_lock:
                    server.inflight -= 1
                    self._pick_lock.notify()
            if status != 200:
                raise SGLangError(f"{where}: HTTP {status}: {raw[:300]!r}")
            try:
                reply = json.loads(raw)
            except json.JSONDecodeError:
                raise SGLangError(f"{where}: reply is not JSON: {raw[:200]!r}") from None
            ids, lps, vers, finish = parse_generate(reply, where)
            p.ids += ids
            p.logprobs += lps
            p.versions += vers
            if self.top_logprobs:
                p.entropy += topk_entropy(reply, where)
            if self.routes is not None:
                self._take_routes(p, reply, where, finish, len(body["input_ids"]))
            interrupted = self._pauses != pauses or not self._resume.is_set()
            if finish == "abort" and interrupted:
                continue  # a weight update cut it short: resubmit prompt + prefix
            break
        if len(p.ids) > budget:
            raise SGLangError(f"request {req.rid}: server returned {len(p.ids)} tokens for a "
                              f"budget of {budget}")
        if finish == "abort" and len(p.ids) >= budget:
            finish = "length"
        routed = None
        if self.routes is not None:
            routed = torch.cat(p.routes) if p.routes else \
                torch.zeros((0, *self.routes[:2]), dtype=self._route_dtype())
            if routed.shape[0] != len(req.prompt_ids) + len(p.ids) - 1:
                raise SGLangError(f"request {req.rid}: {routed.shape[0]} routed positions for "
                                  f"{len(req.prompt_ids)} prompt + {len(p.ids)} output tokens "
                                  "(expected prompt + output - 1)")
        return GenResult(rid=req.rid, prompt_ids=list(req.prompt_ids),
                         output_ids=torch.tensor(p.ids, dtype=torch.int64),
                         logprobs=torch.tensor(p.logprobs, dtype=torch.float32),
                         versions=torch.tensor(p.versions, dtype=torch.int64),
                         finish_reason=finish, entropy=torch.tensor(p.entropy, dtype=torch.float32)
                         if self.top_logprobs else None, routed_experts=routed)

    def _route_dtype(self) -> torch.dtype:
        return torch.uint8 if self.routes is not None and self.routes[2] <= 256 else torch.int32

    def _take_routes(self, p: _Pending, reply: dict, where: str, finish: str,
                     n_input: int) -> None:
        """Append a reply's routes (positions p.route_rows .. input + output - 2) to p. A request
        continued after a weight update keeps the routes its earlier calls returned for the
        positions they forwarded (as the local engine keeps each position's routes from the
        step that forwarded it), and asks the server only for the rest: SGLang recomputes the
        prefix under the new weights, whose routes nothing sampled with. A reply without routes
        is allowed only for an abort that generated nothing (aborted while queued)."""
        got = parse_routes(reply, where, n_input=n_input, start=p.route_rows, shape=self.routes)
        if got is None:
            if finish != "abort" or reply.get("output_ids"):
                raise SGLangError(f"{where}: no meta_info.routed_experts (was the server started "
                                  "with --enable-return-routed-experts?)")
            return
        p.routes.append(got)
        p.route_rows += got.shape[0]

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Stop the servers qurl launched, then leave the weight group (attached servers keep
        running, told to drop it). Stopping comes first: it is what must finish within a stopped
        worker's grace, and a server already gone answers the group's teardown at once."""
        if self._watchdog is not None:
            self._watchdog.close()
        stop_all(self.servers)
        self._leave_group(5.0)
