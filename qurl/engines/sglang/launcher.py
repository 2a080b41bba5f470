"""One SGLang server process: its command line, its HTTP calls, its start, health and stop.

A server is either launched by qurl (`ServerSpec.command` set: qurl may restart it, and stops it,
with its scheduler and detokenizer children, by its process group) or attached (a URL someone
else started: qurl never restarts or stops it). Every HTTP call has a timeout; no answer is
`SGLangUnavailable` (the server may need a restart), a wrong answer `SGLangError` naming the server
and route (protocol.py).
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable
from urllib.parse import urlparse

from qurl.engines.sglang.inside.loader import LOAD_FORMAT as RESTORE_LOAD_FORMAT
from qurl.engines.sglang.inside.loader import KERNELS_LOAD_FORMAT, SYNC_LOAD_FORMAT
from qurl.engines.sglang.protocol import RESTORE_QUANTIZATIONS, SGLangError, SGLangUnavailable
from qurl.weights.nccl_env import settings, with_nccl_defaults

STOP_WAIT_S = 15.0  # `stop`: after SIGTERM, then again after SIGKILL, to the server's process group


def server_command(model_path: str, *, port: int, host: str = "127.0.0.1", tp: int = 1,
                   quantization: str | None = None, weight_version: int = 0,
                   extra: Iterable[str] = (), python: str | None = None,
                   base_gpu: int | None = None) -> list[str]:
    """argv of one `sglang.launch_server` process. W8A8 servers also get
    `--custom-weight-loader` naming qurl's restore (qurl/engines/sglang/inside/loader.py), without which
    they refuse online 8-bit updates. `python`: the interpreter that has sglang (default:
    $QURL_SGLANG_PYTHON, else this one). base_gpu: `--base-gpu-id` (TP rank r computes on GPU
    base_gpu + r; qurl/node/placement.py), unless `extra` sets it."""
    python = python or os.environ.get("QURL_SGLANG_PYTHON") or sys.executable
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--tp-size", str(tp), "--host", host, "--port", str(port),
           "--weight-version", str(weight_version)]
    if quantization:
        cmd += ["--quantization", quantization]
    extra = list(extra)
    if base_gpu is not None and not any(a.split("=")[0] == "--base-gpu-id" for a in extra):
        cmd += ["--base-gpu-id", str(base_gpu)]
    loaders = [RESTORE_LOAD_FORMAT] if quantization in RESTORE_QUANTIZATIONS else []
    loaders += [SYNC_LOAD_FORMAT, KERNELS_LOAD_FORMAT]
    if "--custom-weight-loader" in extra:  # nargs="*": merge, or the last flag would win
        i = j = extra.index("--custom-weight-loader")
        while j + 1 < len(extra) and not extra[j + 1].startswith("--"):
            j += 1
        loaders += [x for x in extra[i + 1:j + 1] if x not in loaders]
        del extra[i:j + 1]
    if loaders:
        cmd += ["--custom-weight-loader", *loaders]
    return cmd + extra


def on_cpu(command: Iterable[str] | None) -> bool:
    """The command line runs SGLang on the CPU (`--device cpu`)."""
    args = list(command or ())
    return "--device=cpu" in args or any(
        a == "--device" and i + 1 < len(args) and args[i + 1] == "cpu" for i, a in enumerate(args))


def launch_env(command: list[str], tp: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a server process starts with: this one with qurl's NCCL settings where
    unset (qurl/weights/nccl_env.py: the same in every process of the weight group), plus, for a CPU server
    (`--device cpu`) with TP size > 1 and no SGLANG_CPU_OMP_THREADS_BIND, one OpenMP core list
    per rank: this process's cores cut into tp equal groups ("0,1|2,3"; SGLang's CPU path
    refuses more ranks than NUMA nodes without it), a core repeated when there are fewer cores
    than ranks ("0|1|0")."""
    env = with_nccl_defaults(os.environ if env is None else env)
    if on_cpu(command) and tp > 1 and not env.get("SGLANG_CPU_OMP_THREADS_BIND"):
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // tp)
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(str(c) for c in cores[r * per:(r + 1) * per]) if len(cores) >= tp
            else str(cores[r % len(cores)]) for r in range(tp))
    return env


def server_nccl(command: Iterable[str], env: dict[str, str]) -> dict[str, str]:
    """The NCCL settings (qurl/weights/nccl_env.py) a server started with `command` in `env` runs
    with, after SGLang 0.5.23 changes its own (entrypoints/engine.py `_set_envs_and_config`,
    lines 1898-1915): NCCL_CUMEM_ENABLE = int(--enable-symm-mem) when unset or with that flag,
    NCCL_NVLS_ENABLE = int(--enable-nccl-nvls or --enable-symm-mem) likewise. (Its KV-shard
    gather, --enable-kv-cache-sharding, may turn cuMem on too: not modelled.)"""
    args, env = set(command), dict(env)
    symm, nvls = "--enable-symm-mem" in args, "--enable-nccl-nvls" in args
    if "NCCL_CUMEM_ENABLE" not in env or symm:
        env["NCCL_CUMEM_ENABLE"] = str(int(symm))
    if "NCCL_NVLS_ENABLE" not in env or nvls or symm:
        env["NCCL_NVLS_ENABLE"] = str(int(nvls or symm))
    return settings(env)


@dataclass
class ServerSpec:
    url: str  # http://host:port
    tp: int = 1
    command: list[str] | None = None  # how to (re)launch it; None = attached, not ours to restart


class Server:
    def __init__(self, spec: ServerSpec, log_dir: Path | None, ready_probe: str = "/health") -> None:
        u = urlparse(spec.url)
        self.ready_probe = ready_probe
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"sglang url {spec.url!r}: expected http://host:port")
        self.spec, self.host, self.port = spec, u.hostname, u.port
        self.proc: subprocess.Popen | None = None
        self.log_path = (log_dir / f"sglang_{self.port}.log") if log_dir else None
        self.inflight = 0
        self.reported_running: int | None = None  # the server's own cap, from /server_info
        self.max_running = 0  # requests qurl sends it at once (SGLangEngine._set_limits)
        self.custom_loaders: tuple[str, ...] = ()  # from /server_info (WeightUpdates._check_server)
        self.layout = None  # TP > 1: the head counts that map each rank's cut (inside/tp_cut.py Layout)
        self.device: str | None = None  # TP > 1: from /server_info ("cpu" pads uneven cuts)
        # the progress watchdog's (watchdog.py): when the server last made
        # progress (time.monotonic), and why it is stalled (None: it is not)
        self.progress_at = time.monotonic()
        self.stalled: str | None = None
        self._calls: set[http.client.HTTPConnection] = set()  # in flight: `abort_calls` cuts them
        self._calls_lock = threading.Lock()

    def call(self, method: str, route: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        with self._calls_lock:
            self._calls.add(conn)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, route, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timeout, cut
            why = f"cut: {self.stalled}" if self.stalled else f"{type(e).__name__}: {e}"
            raise SGLangUnavailable(f"{method} {route} on {self.spec.url}: no answer "
                                    f"({why})") from e
        finally:
            with self._calls_lock:
                self._calls.discard(conn)
            conn.close()

    def abort_calls(self) -> None:
        """Cut every HTTP call to this server in flight: shutting a socket down wakes the thread
        blocked reading it (closing it would not), which then raises SGLangUnavailable. A call
        not yet connected is missed (the watchdog cuts again while the server is stalled)."""
        with self._calls_lock:
            socks = [c.sock for c in self._calls if c.sock is not None]
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def post_json(self, route: str, body: dict, timeout: float, ok_404: bool = False) -> dict | None:
        """POST and parse a JSON object reply; non-2xx or `success: false` -> SGLangError."""
        status, raw = self.call("POST", route, body, timeout)
        if status == 404 and ok_404:
            return None
        try:
            reply = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            raise SGLangError(f"POST {route} on {self.spec.url}: HTTP {status}, reply is not JSON: "
                              f"{raw[:200]!r}") from None
        if not isinstance(reply, dict):
            raise SGLangError(f"POST {route} on {self.spec.url}: reply is not a JSON object: "
                              f"{raw[:200]!r}")
        if status != 200 or reply.get("success") is False:
            raise SGLangError(f"POST {route} on {self.spec.url}: HTTP {status}: "
                              f"{reply.get('message') or reply.get('error') or reply}")
        return reply

    def healthy(self, timeout: float) -> bool:
        """Ready: by default /health, a one-token generation (so it waits, then answers 503 after
        20 s, while the server is paused: `alive` tells paused from dead)."""
        try:
            return self.call("GET", self.ready_probe, None, timeout)[0] == 200
        except SGLangUnavailable:
            return False

    def alive(self, timeout: float) -> bool:
        """The process answers: /model_info is served without the scheduler, paused or not."""
        if self.proc is not None and self.proc.poll() is not None:
            return False
        try:
            return self.call("GET", "/model_info", None, timeout)[0] == 200
        except SGLangUnavailable:
            return False

    def log_tail(self, n: int = 20) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def launch(self) -> None:
        if self.spec.command is None:
            raise SGLangError(f"server {self.spec.url} was attached, not launched by qurl: "
                              "cannot (re)start it")
        self.stop()
        self.stalled, self.progress_at = None, time.monotonic()  # a new process
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        # own session: stopping the server also stops its scheduler/detokenizer children
        self.proc = subprocess.Popen(self.spec.command, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env=launch_env(self.spec.command, self.spec.tp))
        if out is not subprocess.DEVNULL:
            out.close()

    def stop(self) -> None:
        stop_all([self])

    def wait_healthy(self, timeout: float, health_s: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise SGLangError(f"server {self.spec.url} exited with code {self.proc.returncode} "
                                  f"before becoming healthy; log tail:\n{self.log_tail()}")
            if self.healthy(health_s):
                return
            time.sleep(0.2)
        raise SGLangError(f"server {self.spec.url} not healthy after {timeout:.0f}s; "
                          f"log tail:\n{self.log_tail()}")


def stop_all(servers: Iterable[Server]) -> None:
    """Stop the servers qurl launched, all at once: SIGTERM to each one's process group (its
    scheduler and detokenizer too), up to STOP_WAIT_S for all of them together, then SIGKILL to
    those still running and as long again. Attached servers (no process here) are left alone.
    Together, not one after another, so stopping n servers takes the time of one: a worker that
    is itself being stopped has a fixed grace (pipeline/fleet.py) before it is SIGKILLed, and a
    server it has not stopped by then outlives it (it runs in its own session)."""
    live = [s.proc for s in servers if s.proc is not None and s.proc.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in live:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        live = [proc for proc in live if proc.poll() is None]
        if not live:
            return
