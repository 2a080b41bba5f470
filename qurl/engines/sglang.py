"""SGLang rollout engines over HTTP: the only qurl code that talks to SGLang (it never imports it).

(Longer than qurl's ~400-line norm on purpose: the rule that one file holds everything that speaks
SGLang's protocol — launch, health, generate, weight-update sessions — keeps its version-specific
facts in one place to re-check when the pinned SGLang release changes.)

Facts used here, read from the source of sglang 0.5.23 (`srt/entrypoints/http_server.py`,
`srt/managers/io_struct.py`, `srt/managers/tokenizer_manager.py`, `srt/managers/
scheduler_components/weight_updater.py`, `srt/model_executor/model_runner_components/
weight_updater.py`); recheck them when the pinned release changes:

- Launch: `python -m sglang.launch_server --model-path P --tp-size T --quantization Q --host H
  --port N --weight-version V` (`--tp` is not a flag; `--tensor-parallel-size` is an alias).
  `GET /health` answers 503 while starting, 200 when up (body empty).
- `POST /generate` with `{"rid", "input_ids": [int], "sampling_params": {"max_new_tokens",
  "temperature", "top_p", "sampling_seed", "stop_token_ids"}, "return_logprob": true}` answers
  `{"text", "output_ids", "meta_info"}`; `meta_info` has `finish_reason` ({"type": "stop" |
  "length" | "abort", ...}), `output_token_logprobs` ([logprob, token_id, text|None] per generated
  token; logprob of softmax(logits / temperature), before top-p), `completion_tokens`,
  `weight_version` (str) and, on finished requests, `weight_versions` spans
  [{"version", "start", "end"}] when the weights changed under a running request. `output_ids`
  run through the stop token (not trimmed).
- `POST /pause_generation {"mode": "abort"}` aborts every running request — each returns
  normally with finish_reason type "abort" and the tokens generated so far — and holds new ones
  until `POST /continue_generation {}`.
- A weight update must sit inside `POST /begin_weight_update {}` ... `POST /end_weight_update
  {}` (the session restores weights quantized methods repacked after loading, e.g. the transposed
  int8 weight of `w8a8_int8`); outside it `update_weights_from_distributed` fails. Older
  releases lack these routes (404), and then the calls are skipped.
- `POST /init_weights_update_group {"master_address", "master_port", "rank_offset", "world_size",
  "group_name", "backend"}` makes each TP rank join as rank `rank_offset + tp_rank`; the call
  returns only after the group has formed, so the learner must join concurrently.
- `POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
  "flush_cache", "abort_all_requests", "weight_version", "load_format"}` returns only after the
  broadcast(s) it describes have been received and loaded (so the learner broadcasts while the
  call is in flight). `load_format="flattened_bucket"` = one uint8 broadcast per call (qurl's
  bucket layout), `null` = one broadcast per tensor. `flush_cache: true` fails while requests run.
- Replies of control routes are `{"success": bool, "message": str}` with 200 or 400;
  `/flush_cache` answers plain text with 200 or 400; `/pause_generation` and
  `/continue_generation` answer `{"message", "status": "ok"}`.
- 8-bit formats (see qurl/models/export8bit.py): `w8a8_int8` (int8 `weight` + fp32
  `weight_scale` [out, 1]), `w8a8_fp8` (per-channel FP8, same names), `fp8` with
  `weight_block_size` [128, 128] (FP8 `weight` + fp32 `weight_scale_inv`). SGLang's `fp8` method
  without blocks is per-TENSOR, so per-channel FP8 is `w8a8_fp8`. Weight names are HF names;
  SGLang's loader fuses q/k/v and gate/up itself. Unknown names are ignored by SGLang, silently.

Design. One `SGLangEngine` drives N servers as one Engine (engines/base.py). Requests are spread
over the servers (least in flight). Each sync (`load_weights`) pauses every server (abort mode),
opens the update session, broadcasts the chunks bucket by bucket (qurl/sync/broadcaster.py, the
routine the async controller uses too) to the weight group (learner rank 0 + every server rank)
while one HTTP call per server per bucket is in flight, closes the session, flushes caches and
continues. Requests interrupted by the pause come back with their partial output; they are
resubmitted as prompt + generated prefix with the remaining token budget, and the pieces are stitched with per-token versions (partial rollout).
A server that refuses a bucket (HTTP 400 before joining its broadcast) is reported while the
broadcast is in flight, not after the group timeout (qurl/sync/sender.py). Before use, each
server's /server_info must agree with what qurl was told (TP size; the W8A8 restore loader); it
also tells whether the servers run qurl's sync loader, which makes deltas and verification
possible (qurl/sync/sglang_delta.py, qurl/engines/sglang_server.py).
Servers qurl launches get GPUs of their own after the learner's (`--base-gpu-id`,
qurl/placement.py); the weight group's backend is sglang.backend.
A server that stops answering is restarted (when qurl launched it), the weight group is formed
anew, and the current weights are sent again (so the engine keeps the last synced chunks in CPU
memory: the size of the 8-bit model). Every HTTP call has a timeout; a malformed reply is an
SGLangError naming the server, route and what is wrong. Limits: with NCCL, servers that survive a
peer dying in the middle of a broadcast stay blocked in it until SGLang's group timeout (30 min
by default); gloo reports the broken connection at once. This file is longer than most because
the project keeps every line that talks to SGLang in this one module.
"""
from __future__ import annotations

import base64
import http.client
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlparse

import torch

from qurl.config import ConfigError, SGLangConfig
from qurl.engines.sglang_loader import LOAD_FORMAT as RESTORE_LOAD_FORMAT
from qurl.engines.sglang_loader import SYNC_LOAD_FORMAT
from qurl.sync.broadcaster import Broadcaster, GroupFormError, GroupSpec
from qurl.sync.group import free_port
from qurl.sync.sender import BucketAnnouncement, SyncStats
from qurl.sync.sglang_delta import SGLangDeltaMixin, is_stale_refusal
from qurl.types import GenRequest, GenResult

# precision (+ fp8 scaling) -> (SGLang --quantization, qurl sync format)
QUANTIZATION = {"int8": ("w8a8_int8", "int8"), "fp8": ("w8a8_fp8", "fp8"),
                "fp8_block": ("fp8", "fp8_block"), "bf16": (None, "bf16")}
# --quantization methods that repack weights after loading without a restore (sglang_loader.py)
RESTORE_QUANTIZATIONS = ("w8a8_int8", "w8a8_fp8")
# an empty named-tensor list, as SGLang's MultiprocessingSerializer reads it (pickle, base64)
_NO_TENSORS = base64.b64encode(pickle.dumps([])).decode()


class SGLangError(RuntimeError):
    """A server answered wrongly (or not at all); the message names the server and route."""


class SGLangUnavailable(SGLangError):
    """The server did not answer (refused, reset, timed out): it may need a restart."""


def server_command(model_path: str, *, port: int, host: str = "127.0.0.1", tp: int = 1,
                   quantization: str | None = None, weight_version: int = 0,
                   extra: Iterable[str] = (), python: str | None = None,
                   base_gpu: int | None = None) -> list[str]:
    """argv of one `sglang.launch_server` process, with `--custom-weight-loader` naming qurl's
    sync loader (delta and verified syncs, qurl/sync/sglang_delta.py) and, for W8A8 servers,
    qurl's restore (qurl/engines/sglang_loader.py), without which they refuse online 8-bit
    updates. `python`: the interpreter that has sglang (default:
    $QURL_SGLANG_PYTHON, else this one). base_gpu: `--base-gpu-id` (TP rank r computes on GPU
    base_gpu + r; qurl/placement.py), unless `extra` sets it."""
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
    loaders.append(SYNC_LOAD_FORMAT)
    if "--custom-weight-loader" in extra:  # nargs="*": merge, or the last flag would win
        i = j = extra.index("--custom-weight-loader")
        while j + 1 < len(extra) and not extra[j + 1].startswith("--"):
            j += 1
        loaders += [x for x in extra[i + 1:j + 1] if x not in loaders]
        del extra[i:j + 1]
    if loaders:
        cmd += ["--custom-weight-loader", *loaders]
    return cmd + extra


@dataclass
class ServerSpec:
    url: str  # http://host:port
    tp: int = 1
    command: list[str] | None = None  # how to (re)launch it; None = attached, not ours to restart


@dataclass
class Timeouts:
    control_s: float = 60.0  # pause, continue, flush, begin/end, version
    generate_s: float = 1800.0  # one /generate call (long reasoning rollouts)
    group_s: float = 600.0  # forming the group; one bucket's broadcast + load
    launch_s: float = 900.0  # process start until /health answers 200
    health_s: float = 10.0  # one /health probe


class _Server:
    def __init__(self, spec: ServerSpec, log_dir: Path | None, ready_probe: str = "/health") -> None:
        u = urlparse(spec.url)
        self.ready_probe = ready_probe
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"sglang url {spec.url!r}: expected http://host:port")
        self.spec, self.host, self.port = spec, u.hostname, u.port
        self.proc: subprocess.Popen | None = None
        self.log_path = (log_dir / f"sglang_{self.port}.log") if log_dir else None
        self.inflight = 0
        self.custom_loaders: tuple[str, ...] = ()  # from /server_info (_check_server)

    def call(self, method: str, route: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, route, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timeout
            raise SGLangUnavailable(f"{method} {route} on {self.spec.url}: no answer "
                                    f"({type(e).__name__}: {e})") from e
        finally:
            conn.close()

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
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        # own session: stopping the server also stops its scheduler/detokenizer children
        self.proc = subprocess.Popen(self.spec.command, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        if out is not subprocess.DEVNULL:
            out.close()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

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


def parse_generate(reply: Any, where: str) -> tuple[list[int], list[float], list[int], str]:
    """(token ids, logprobs, versions per token, finish type) from a /generate reply."""
    if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
        raise SGLangError(f"{where}: reply has no 'meta_info' object: {str(reply)[:200]}")
    meta, ids = reply["meta_info"], reply.get("output_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise SGLangError(f"{where}: 'output_ids' must be a list of ints, got {str(ids)[:100]}")
    lps = meta.get("output_token_logprobs")
    if not isinstance(lps, list) or len(lps) != len(ids):
        raise SGLangError(f"{where}: meta_info.output_token_logprobs has "
                          f"{len(lps) if isinstance(lps, list) else lps!r} entries for "
                          f"{len(ids)} output_ids (was return_logprob set?)")
    logprobs = []
    for k, (entry, tok) in enumerate(zip(lps, ids)):
        if not isinstance(entry, list) or len(entry) < 2 or entry[1] != tok \
                or not isinstance(entry[0], (int, float)) or not math.isfinite(entry[0]):
            raise SGLangError(f"{where}: output_token_logprobs[{k}] = {entry!r} is not "
                              f"[finite logprob, {tok}, text]")
        logprobs.append(float(entry[0]))
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        raise SGLangError(f"{where}: meta_info.finish_reason = {finish!r}")

    def as_int(v: Any) -> int:
        try:
            return int(v)
        except (TypeError, ValueError):
            raise SGLangError(f"{where}: weight version {v!r} is not an integer (qurl sets "
                              "versions; was the server started with --weight-version?)") from None

    versions = [as_int(meta.get("weight_version"))] * len(ids)
    for span in meta.get("weight_versions") or []:
        if not isinstance(span, dict) or not {"version", "start", "end"} <= span.keys():
            raise SGLangError(f"{where}: bad weight_versions span {span!r}")
        for k in range(max(0, span["start"]), min(len(ids), span["end"])):
            versions[k] = as_int(span["version"])
    return ids, logprobs, versions, finish["type"]


class _Replies:
    """The servers' replies to one bucket's announcement. Calling it waits for all of them (after
    the broadcast); `poll` raises a reply that already came back with an error — a server that
    refused the bucket never joins its broadcast, so the sender polls while broadcasting
    (qurl/sync/sender.py) instead of waiting for the group timeout."""

    def __init__(self, ex: ThreadPoolExecutor, futs: list) -> None:
        self.ex, self.futs = ex, futs

    def poll(self) -> None:
        for f in self.futs:
            if f.done() and f.exception() is not None:
                self.ex.shutdown(wait=False)
                raise f.exception()

    def __call__(self) -> None:
        self.ex.shutdown(wait=True)
        for f in self.futs:
            f.result()


@dataclass
class _Pending:
    """One request being generated, possibly over several /generate calls."""

    req: GenRequest
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0


class SGLangEngine(SGLangDeltaMixin):
    """Engine (engines/base.py) over SGLang servers; see the module docstring (deltas and
    verification: qurl/sync/sglang_delta.py)."""

    def __init__(self, servers: list[ServerSpec], *, precision: str = "int8",
                 group_host: str = "127.0.0.1", group_port: int = 0, backend: str = "auto",
                 bucket_bytes: int = 64 << 20, load_format: str = "flattened_bucket",
                 timeouts: Timeouts | None = None, log_dir: str | Path | None = None,
                 max_restarts: int = 3, poll_s: float = 0.05, keep_weights: bool = True,
                 tokenizer: Any = None, vocab_size: int = 0, ready_probe: str = "/health") -> None:
        """`tokenizer` / `vocab_size`: the served model's (the loops encode prompts with it and
        validate token ids against it); from_section reads both from the model directory.
        `ready_probe`: what a (re)started server must answer 200 before use: "/health" (a real
        one-token generation) or "/model_info" (model loaded; for servers that cannot generate,
        such as 8-bit SGLang on a CPU)."""
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
        self.precision = precision
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
        self.servers = [_Server(s, log, ready_probe) for s in servers]
        self._lock = threading.RLock()  # syncs and recoveries, one at a time
        self._pick_lock = threading.Lock()  # request routing counters only
        self._resume = threading.Event()  # cleared while weights change: no new submissions
        self._resume.set()
        self._holds = 0
        self._pauses = 0  # bumped by every pause: tells an aborted request it was interrupted
        self._recoveries = 0
        self._version = 0
        self._weights: list[tuple[str, torch.Tensor]] | None = None  # last synced chunks
        self._disk: str | None = None  # or: last update_weights_from_disk path
        self.restarts = 0
        self.last_sync: SyncStats | None = None
        self._group_name: str | None = None  # the servers' current weight group
        try:
            for s in self.servers:
                if s.spec.command is not None:
                    s.launch()
            for s in self.servers:
                s.wait_healthy(self.timeouts.launch_s, self.timeouts.health_s)
            self._each(self._check_server, self.timeouts.control_s * 2)
            self._set_version_all(0)
            self._form_group()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- construction helpers
    @classmethod
    def from_section(cls, sg: SGLangConfig, model_dir: str, *, precision: str, run_dir: Path,
                     count: int, uaq_scale: float, group_host: str, group_port: int,
                     bucket_bytes: int, slot: int | None = None,
                     base_gpus: list[int] | None = None) -> "SGLangEngine":
        """Attach to `sg.urls`, or export `model_dir` as an 8-bit checkpoint (UAQ-scaled, under
        run_dir) and launch local servers on free ports: `count` of them for the sync loop (slot
        None), or the one server of async worker `slot` (its URL is sg.urls[slot]). group_host /
        group_port: where the servers reach this process's weight group (port 0 = a free one).
        base_gpus: the first GPU of each launched server (`--base-gpu-id`; qurl/placement.py
        `sglang_base_gpus`), unless sg.args sets it; None = no placement (CPU)."""
        quant, fmt = QUANTIZATION[precision]
        urls = list(sg.urls)
        if slot is not None:
            if urls and len(urls) != count:
                raise ValueError(f"sglang.urls has {len(urls)} servers: asynchronous rollout needs "
                                 f"one per worker (deploy.engines={count})")
            urls, count = urls[slot:slot + 1], 1
        if urls:
            specs = [ServerSpec(u, tp=sg.tp) for u in urls]
        else:
            from qurl.models.export8bit import export_8bit

            name = f"sglang_{fmt}" if slot is None else f"sglang_{fmt}_w{slot}"  # no shared writes
            ckpt = export_8bit(model_dir, run_dir / name, fmt, uaq_scale=uaq_scale)
            if base_gpus is not None and len(base_gpus) != count:
                raise ValueError(f"base_gpus {base_gpus}: one per server ({count})")
            specs = []
            for i in range(count):
                port = free_port()
                cmd = server_command(str(ckpt), port=port, tp=sg.tp, quantization=quant,
                                     extra=sg.args, base_gpu=None if base_gpus is None
                                     else base_gpus[i])
                specs.append(ServerSpec(f"http://127.0.0.1:{port}", tp=sg.tp, command=cmd))
        from transformers import AutoConfig, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        vocab = int(AutoConfig.from_pretrained(str(model_dir), local_files_only=True).vocab_size)
        return cls(specs, precision=precision, group_host=group_host, group_port=group_port,
                   backend=sg.backend, bucket_bytes=bucket_bytes, log_dir=run_dir / "logs",
                   tokenizer=tok, vocab_size=vocab)

    @property
    def version(self) -> int:
        return self._version

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

    def _each(self, fn: Callable[[_Server], Any], timeout: float) -> list[Any]:
        """Run fn on every server concurrently (they are independent processes)."""
        with ThreadPoolExecutor(max_workers=len(self.servers)) as ex:
            futs = [ex.submit(fn, s) for s in self.servers]
            return [f.result(timeout=timeout) for f in futs]

    def _set_version_all(self, version: int) -> None:
        self._each(lambda s: s.post_json("/update_weight_version",
                                         {"new_version": str(version), "abort_all_requests": False},
                                         self.timeouts.control_s), self.timeouts.control_s * 2)

    def _leave_group(self, timeout_s: float) -> None:
        """Tell the servers to drop the last group formed (best effort: a restarted server has
        none) and close our side. Also after a failed sync closed ours: a broadcast abandoned
        there (a refused bucket) ends when the servers leave the group."""
        if self._group_name is not None:
            body = {"group_name": self._group_name}

            def destroy(s: _Server) -> None:
                try:
                    s.post_json("/destroy_weights_update_group", body, timeout_s)
                except SGLangError:
                    pass
            # all at once: a server still inside the abandoned broadcast answers only after the
            # server that refused it has left (its scheduler runs one request at a time)
            self._each(destroy, 2 * timeout_s)
            self._group_name = None
        self.weights.close()

    def _form_group(self) -> None:
        """(Re)form the weight group: this process + every TP rank of every server."""
        self._leave_group(self.timeouts.control_s)
        offsets = [1 + sum(s.spec.tp for s in self.servers[:i]) for i in range(len(self.servers))]

        def invite(spec: GroupSpec) -> Callable[[], None]:
            self._group_name = spec.name  # from now on the servers may hold it
            ex = ThreadPoolExecutor(max_workers=len(self.servers))
            futs = [ex.submit(s.post_json, "/init_weights_update_group",
                              {"master_address": spec.host, "master_port": spec.port,
                               "rank_offset": off, "world_size": spec.world,
                               "group_name": spec.name, "backend": spec.backend},
                              self.timeouts.group_s)
                    for s, off in zip(self.servers, offsets)]

            def wait() -> None:
                ex.shutdown(wait=True)
                for f in futs:
                    f.result()
            return wait

        try:
            self.weights.form(1 + sum(s.spec.tp for s in self.servers), invite,
                              timeout_s=self.timeouts.group_s)
        except GroupFormError as e:
            raise SGLangError(str(e)) from e

    # ---------------------------------------------------------------- weights
    def load_weights(self, chunks: Iterable[tuple[str, torch.Tensor]], version: int,
                     base: tuple[int, str] | None = None) -> None:
        """Send engine chunks (already 8-bit: see qurl.quant.named.engine_chunks) to every server
        as `version`; with base = (v-1, digest) they are a delta (qurl/sync/sglang_delta.py;
        StaleBase if a server does not hold that base). Recovers dead servers (restart + new
        group + resend) up to max_restarts."""
        chunks = list(chunks)
        with self._hold():
            wire = self._wire(chunks, version, base)
            for attempt in range(self.max_restarts + 1):
                try:
                    self.last_sync = self._sync(wire, version)
                    break
                except SGLangError as e:
                    if is_stale_refusal(str(e)):  # refused before writing: nothing to redo here
                        from qurl.engines.local import StaleBase
                        self._recover(e, resend=False)
                        raise StaleBase(f"SGLang delta v{version} refused: {e}") from e
                    if attempt == self.max_restarts:
                        raise
                    self._recover(e, resend=False)
            self._version = version
            kept = self._keep_version(chunks, base)
            self._weights, self._disk = (kept if self.keep_weights else None), None

    def _announce(self, version: int) -> Callable[[BucketAnnouncement], Callable[[], None]]:
        def announce(ann: BucketAnnouncement) -> Callable[[], None]:
            body = {"names": ann.layout.names, "dtypes": ann.layout.dtypes,
                    "shapes": ann.layout.shapes, "group_name": self.weights.group.group_name,
                    "flush_cache": False, "abort_all_requests": False,
                    "weight_version": str(version) if ann.last else None,
                    "load_format": "flattened_bucket" if ann.load_format == "flattened_bucket"
                    else None}
            ex = ThreadPoolExecutor(max_workers=len(self.servers))
            return _Replies(ex, [ex.submit(s.post_json, "/update_weights_from_distributed", body,
                                           self.timeouts.group_s) for s in self.servers])
        return announce

    def _sync(self, chunks: list[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        c = self.timeouts.control_s
        t0 = time.perf_counter()
        with self._hold():
            self._pauses += 1
            self._each(lambda s: s.post_json("/pause_generation", {"mode": "abort"}, c), 2 * c)
            sessions = self._each(lambda s: s.post_json("/begin_weight_update", {}, c, ok_404=True),
                                  2 * c)
            if self.delta_capable:  # qurl's sync loader: W8A8 restore + delta / verify hook
                self._each(self._prepare, 2 * c)
            elif QUANTIZATION[self.precision][0] in RESTORE_QUANTIZATIONS:
                self._each(self._restore_w8a8, 2 * c)
            t1 = time.perf_counter()
            try:
                stats = self.weights.send(chunks, version, announce=self._announce(version))
            except RuntimeError as e:  # the group broke (a server died mid-broadcast): recoverable
                if isinstance(e, SGLangError):
                    raise
                raise SGLangUnavailable(f"weight broadcast to the servers failed: {e}") from e
            t2 = time.perf_counter()
            self._each(lambda s: None if sessions[self.servers.index(s)] is None else
                       s.post_json("/end_weight_update", {}, c), 2 * c)
            self._each(self._flush, 2 * c)
            self._each(lambda s: s.post_json("/continue_generation", {}, c), 2 * c)
        stats.extra.update({"pause_s": t1 - t0, "finish_s": time.perf_counter() - t2})
        return stats

    def _check_server(self, s: _Server) -> None:
        """Refuse, from its /server_info, a server that is not what qurl was told: a TP size other
        than spec.tp (the weight group would wait for ranks that never come, or leave some out,
        until the group timeout), or a W8A8 server that cannot run qurl's restore (asking it
        for an unknown load_format kills its scheduler: SGLang 0.5.23 raises NotImplementedError
        there). A server without /server_info (older releases) is taken at its word."""
        status, raw = s.call("GET", "/server_info", None, self.timeouts.control_s)
        try:
            info = json.loads(raw) if status == 200 else None
        except json.JSONDecodeError:
            info = None
        if not isinstance(info, dict):
            return
        tp = info.get("tp_size")
        if isinstance(tp, int) and tp != s.spec.tp:
            raise SGLangError(f"server {s.spec.url} runs --tp-size {tp} but qurl was told "
                              f"sglang.tp={s.spec.tp}: set sglang.tp={tp}")
        loaders = info.get("custom_weight_loader")
        s.custom_loaders = tuple(loaders) if isinstance(loaders, list) else ()
        if QUANTIZATION[self.precision][0] in RESTORE_QUANTIZATIONS and loaders is not None \
                and RESTORE_LOAD_FORMAT not in loaders:
            raise SGLangError(f"server {s.spec.url} serves {QUANTIZATION[self.precision][0]} "
                              f"without --custom-weight-loader {RESTORE_LOAD_FORMAT} (it has "
                              f"{loaders}): it would refuse 8-bit updates; relaunch it with that "
                              "flag and qurl importable by its Python")

    def _restore_w8a8(self, s: _Server) -> None:
        """Undo the W8A8 post-load repacking on every TP rank of `s` (qurl/engines/sglang_loader.py)
        so the 8-bit broadcasts that follow can load; needs the server's --custom-weight-loader."""
        body = {"serialized_named_tensors": [_NO_TENSORS] * s.spec.tp,
                "load_format": RESTORE_LOAD_FORMAT, "flush_cache": False,
                "abort_all_requests": False}
        try:
            s.post_json("/update_weights_from_tensor", body, self.timeouts.control_s)
        except SGLangUnavailable:
            raise
        except SGLangError as e:
            raise SGLangError(f"{e}\n(8-bit updates of a {QUANTIZATION[self.precision][0]} server "
                              f"need it launched with --custom-weight-loader "
                              f"{RESTORE_LOAD_FORMAT} and qurl importable by its Python)") from e

    def _flush(self, s: _Server) -> None:
        status, raw = s.call("POST", "/flush_cache", None, self.timeouts.control_s)
        if status != 200:
            raise SGLangError(f"POST /flush_cache on {s.spec.url}: HTTP {status}: {raw[:200]!r}")

    def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Fallback sync: every server reloads a checkpoint directory from disk (bf16 or block
        fp8: SGLang 0.5.23 reloads W8A8 checkpoints through the same loaders that refuse online
        updates, outside any session in which qurl's restore could run)."""
        quant = QUANTIZATION[self.precision][0]
        if quant in RESTORE_QUANTIZATIONS:
            raise SGLangError(f"update_weights_from_disk: {quant} servers cannot reload from disk "
                              "online (SGLang 0.5.23); use load_weights")
        c = self.timeouts.control_s
        with self._hold():
            self._pauses += 1
            self._each(lambda s: s.post_json("/pause_generation", {"mode": "abort"}, c), 2 * c)
            self._each(lambda s: s.post_json(
                "/update_weights_from_disk", {"model_path": str(model_path),
                                              "weight_version": str(version),
                                              "flush_cache": True}, self.timeouts.group_s),
                2 * self.timeouts.group_s)
            self._each(lambda s: s.post_json("/continue_generation", {}, c), 2 * c)
            self._version, self._disk, self._weights = version, str(model_path), None
            self._digest = None

    # ---------------------------------------------------------------- recovery
    def _recover(self, cause: Exception, resend: bool = True) -> None:
        """Restart every server that does not answer, form a new group, resend the weights.

        Dead means the process does not answer /model_info (or has exited): a server paused by a
        sync that failed half-way is alive, and must not be judged by /health, which waits
        behind the pause (see `_Server.healthy`)."""
        with self._hold():
            self._recoveries += 1
            self._digest = None  # a restarted server holds its checkpoint until resent: unverified
            dead = [s for s in self.servers if not s.alive(self.timeouts.health_s)]
            for s in dead:
                if s.spec.command is None:
                    raise SGLangError(f"server {s.spec.url} stopped answering and was attached, "
                                      f"not launched by qurl, so it cannot be restarted ({cause})")
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
        with ThreadPoolExecutor(max_workers=min(len(requests), 256)) as ex:
            futs = [ex.submit(self._run, r) for r in requests]
            while not all(f.done() for f in futs):
                time.sleep(self.poll_s)
                if between_steps is not None:
                    between_steps()
            return [f.result() for f in futs]

    def _pick(self) -> _Server:
        with self._pick_lock:
            s = min(self.servers, key=lambda x: x.inflight)
            s.inflight += 1
            return s

    def _run(self, req: GenRequest) -> GenResult:
        p = _Pending(req)
        budget = req.params.max_new_tokens
        finish = "length"
        while len(p.ids) < budget:
            self._resume.wait()
            pauses, recoveries = self._pauses, self._recoveries
            server = self._pick()
            sp = {"max_new_tokens": budget - len(p.ids), "temperature": req.params.temperature,
                  "top_p": req.params.top_p}
            if req.params.seed is not None:
                sp["sampling_seed"] = req.params.seed
            if req.params.stop_token_ids:
                sp["stop_token_ids"] = list(req.params.stop_token_ids)
            body = {"rid": f"{req.rid}#{p.calls}", "input_ids": list(req.prompt_ids) + p.ids,
                    "sampling_params": sp, "return_logprob": True, "stream": False}
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
            interrupted = self._pauses != pauses or not self._resume.is_set()
            if finish == "abort" and interrupted:
                continue  # a weight update cut it short: resubmit prompt + prefix
            break
        if len(p.ids) > budget:
            raise SGLangError(f"request {req.rid}: server returned {len(p.ids)} tokens for a "
                              f"budget of {budget}")
        if finish == "abort" and len(p.ids) >= budget:
            finish = "length"
        return GenResult(rid=req.rid, prompt_ids=list(req.prompt_ids),
                         output_ids=torch.tensor(p.ids, dtype=torch.int64),
                         logprobs=torch.tensor(p.logprobs, dtype=torch.float32),
                         versions=torch.tensor(p.versions, dtype=torch.int64),
                         finish_reason=finish)

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Leave the weight group and stop the servers qurl launched (attached ones keep running)."""
        self._leave_group(5.0)
        for s in self.servers:
            s.stop()
