"""The weight-update session of SGLang servers: the weight group, 8-bit broadcasts, disk reloads.

Each sync (`load_weights`) pauses every server (abort mode), opens the update session
(`/begin_weight_update`), runs qurl's W8A8 restore on servers that need it
(qurl/engines/sglang/inside/loader.py), broadcasts the chunks bucket by bucket (qurl/weights/broadcaster.py,
the routine the async controller uses too) to the weight group (learner rank 0 + every server TP
rank) while one `/update_weights_from_distributed` call per server per bucket is in flight, closes
the session, flushes caches and continues. A server that refuses a bucket (HTTP 400 before joining
its broadcast) is reported while the broadcast is in flight, not after the group timeout
(`Replies.poll`, qurl/weights/sender.py). Before use, each server's /server_info must agree with what
qurl was told (TP size; the W8A8 restore loader).

`WeightUpdates` is the part of `SGLangEngine` (engine.py) that does this; it
uses the engine's servers, timeouts, weight group (`weights`: a Broadcaster), its hold on
submissions (`_hold`), `_each` and `_recover`.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch

from qurl.types import StaleBase
from qurl.engines.sglang.inside.loader import LOAD_FORMAT as RESTORE_LOAD_FORMAT
from qurl.engines.sglang.launcher import Server, launch_env, on_cpu, server_nccl
from qurl.engines.sglang.protocol import (NO_TENSORS, QUANTIZATION, RESTORE_QUANTIZATIONS,
                                          SGLangError, SGLangUnavailable, running_limit)
from qurl.engines.sglang.verified_sync import SGLangDeltaMixin, is_stale_refusal
from qurl.weights.broadcaster import GroupFormError, GroupSpec
from qurl.weights.sender import BucketAnnouncement, SyncStats


class Replies:
    """The servers' replies to one bucket's announcement. Calling it waits for all of them (after
    the broadcast); `poll` raises a reply that already came back with an error — a server that
    refused the bucket never joins its broadcast, so the sender polls while broadcasting
    (qurl/weights/sender.py) instead of waiting for the group timeout."""

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


class WeightUpdates(SGLangDeltaMixin):
    """SGLangEngine's weight group and update sessions (see the module docstring; deltas and
    verification: verified_sync.py)."""

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

            def destroy(s: Server) -> None:
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
            # SGLang's ranks cannot report their NCCL settings at the join: those of the
            # servers qurl launched are known from their launch (attached ones: not checked)
            known = {f"sglang {s.spec.url}": server_nccl(s.spec.command,
                                                         launch_env(s.spec.command, s.spec.tp))
                     for s in self.servers if s.spec.command is not None}
            self.weights.form(1 + sum(s.spec.tp for s in self.servers), invite,
                              timeout_s=self.timeouts.group_s, reporters=(), known=known)
        except GroupFormError as e:
            raise SGLangError(str(e)) from e

    # ---------------------------------------------------------------- weights
    def load_weights(self, chunks: Iterable[tuple[str, torch.Tensor]], version: int,
                     base: tuple[int, str] | None = None) -> None:
        """Send engine chunks (already 8-bit: see qurl.quant.named.engine_chunks) to every server
        as `version`; with base = (v-1, digest) they are a delta (verified_sync.py;
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
            return Replies(ex, [ex.submit(s.post_json, "/update_weights_from_distributed", body,
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

    def _check_server(self, s: Server) -> None:
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
        s.reported_running = running_limit(info)  # None without a usable /server_info
        if not isinstance(info, dict):
            return
        tp = info.get("tp_size")
        if isinstance(tp, int) and tp != s.spec.tp:
            raise SGLangError(f"server {s.spec.url} runs --tp-size {tp} but qurl was told "
                              f"sglang.tp={s.spec.tp}: set sglang.tp={tp}")
        loaders = info.get("custom_weight_loader")
        s.custom_loaders = tuple(loaders) if isinstance(loaders, list) else ()
        if s.spec.tp > 1:  # the head counts that map a rank's cut (deltas, verification)
            s.layout = self._find_layout(s)
            s.device = info.get("device") or ("cpu" if on_cpu(s.spec.command) else None)
        if QUANTIZATION[self.precision][0] in RESTORE_QUANTIZATIONS and loaders is not None \
                and RESTORE_LOAD_FORMAT not in loaders:
            raise SGLangError(f"server {s.spec.url} serves {QUANTIZATION[self.precision][0]} "
                              f"without --custom-weight-loader {RESTORE_LOAD_FORMAT} (it has "
                              f"{loaders}): it would refuse 8-bit updates; relaunch it with that "
                              "flag and qurl importable by its Python")

    def _restore_w8a8(self, s: Server) -> None:
        """Undo the W8A8 post-load repacking on every TP rank of `s` (qurl/engines/sglang/inside/loader.py)
        so the 8-bit broadcasts that follow can load; needs the server's --custom-weight-loader."""
        body = {"serialized_named_tensors": [NO_TENSORS] * s.spec.tp,
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

    def _flush(self, s: Server) -> None:
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
