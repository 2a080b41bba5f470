"""A rollout worker's side of weight sync: join the weight group, receive each version, verify it.

Every sync is verified: after the receiver commits a version the worker hashes what its engine
holds against the learner's digests (qurl/weights/digest.py, sent with the first announcement). A
delta whose base the engine does not hold verified is refused before anything is written (the
engine keeps its version); a mismatch leaves the engine unverified. Either way the worker abandons
the generation in progress (its prompts go back to the queue) and generates nothing until a full
sync verifies. Either way it asks the controller for a full sync (`resync` with the reason; a
mismatch also names the engine and the tensors that differ, for the controller's error when the
full sync fails too) and stays in the group; the worker says how many prompts it queued again
(`redone`, worker.py). The worker only reports; what follows (resend in full, or halt
the run) is the controller's decision, made by the same rule the synchronous loop applies
(qurl/weights/resync.py `ResyncRule`, per worker slot in fleet.py).

`WeightClient` is that part of `RolloutWorker` (worker.py): it uses the worker's
engine and its `kind` (qurl/engines/kind.py), inbox, session, counts and `_queue_prompt` /
`_handle` / `_send_control`. `Abort` and `Unverified` are how a sync (or a control message) stops
the generation in progress.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from qurl.types import StaleBase, verifiable
from qurl.weights.resync import MISMATCH, REFUSED, engine_label

log = logging.getLogger("qurl.worker")


class Abort(Exception):
    """Abandon the current generation (controller changed or asked us to stop)."""


class Unverified(Abort):
    """The engine's weights failed verification: redo the current generation after a resync."""


class WeightClient:
    """RolloutWorker's weight group membership, weight receipt and verification."""

    def _leave_group(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = self.weights_rx = None
        self.joined = False

    def _join_group(self, meta: dict[str, Any]) -> None:
        from qurl.weights.receiver import WeightReceiver
        from qurl.weights.group import GroupAddressError, WeightGroup

        self._leave_group()
        gen = meta.get("gen")
        self.gen_seen = gen if isinstance(gen, int) else self.gen_seen
        try:
            self.group = WeightGroup(str(meta["host"]), int(meta["port"]), int(meta["rank"]),
                                     int(meta["world"]), backend=str(meta.get("backend", "gloo")),
                                     group_name=str(meta.get("name", "qurl_weights")),
                                     timeout_s=float(meta.get("timeout_s", 300.0)))
        except GroupAddressError as e:  # cannot ever form from here: say why once, exit
            log.error("slot %d: %s", self.slot, e)
            self._leave_group()
            self.stop, self.exit_code = True, 2
            return
        except Exception as e:  # the controller times out too and forms a new group
            log.warning("slot %d: joining weight group gen %s failed: %s", self.slot,
                        meta.get("gen"), e)
            self._leave_group()
            return
        # The local engine adopts the receive buffers (two banks, no copy: qurl/weights/receiver.py);
        # the SGLang adapter keeps the chunks (to re-send them to a restarted server): fresh buffers.
        self.weights_rx = WeightReceiver(self.group, self.engine,
                                         reuse_buffers=self.kind.adopts_receive_buffers)
        self.joined = True
        log.info("slot %d: joined weight group gen %s", self.slot, meta.get("gen"))

    def _receive_weights(self, first: dict[str, Any]) -> None:
        if not self.joined:
            self.counts["bad_control"] += 1
            return
        t0 = time.perf_counter()
        pending = [first]
        deferred: list[Any] = []  # a control message that ends this sync (e.g. a new group)

        def next_announcement() -> dict[str, Any]:
            # Called from the receiver's fetch thread; the main thread is inside load_weights and
            # does not touch the inbox until receive() returns, so the socket has one user.
            if pending:
                return pending.pop()
            deadline = time.monotonic() + 300.0
            while time.monotonic() < deadline:
                msg = self.inbox.recv(timeout_ms=1000)
                if msg is None or msg.meta.get("session") != self.session:
                    continue
                if msg.kind == "prompt":
                    self._queue_prompt(msg)
                    continue
                op = msg.meta.get("op")
                if op == "weights":
                    return msg.meta
                if op == "ping":
                    continue
                deferred.append(msg)
                raise RuntimeError(f"control {op!r} arrived inside a weight sync")
            raise TimeoutError("no next bucket announcement within 300 s")

        try:
            stats = self.weights_rx.receive(next_announcement)
        except StaleBase as e:  # every broadcast was joined: the group is fine, ask for all
            self.counts["delta_refused"] += 1
            log.warning("slot %d: delta v%s refused: %s", self.slot, first.get("version"), e)
            self._send_control({"op": "resync", "reason": REFUSED,
                                "version": int(self.engine.version)})
            self.weights_ok = False  # behind the controller's version: wait for the full sync
            for msg in deferred:
                self._handle(msg)
            raise Unverified()
        except Exception as e:  # dead peer, timeout, bad chunk: the controller re-forms the group
            self.counts["sync_failures"] += 1
            log.warning("slot %d: weight sync v%s failed: %s", self.slot, first.get("version"), e)
            self._leave_group()
            for msg in deferred:
                self._handle(msg)
            return
        self.counts["syncs"] += 1
        verified, t1 = self._verify(stats.header), time.perf_counter()
        bad = self._bad[:8]
        self._send_control({"op": "synced", "version": int(self.engine.version),
                            "load_s": stats.total_s, "recv_s": stats.recv_s,
                            "pause_s": t1 - t0, "bytes": stats.bytes, "verified": verified,
                            "mode": (stats.header or {}).get("mode", "full")})
        if verified == 0.0:  # the tensors and engine name the error of a second failure
            self._send_control({"op": "resync", "reason": MISMATCH, "bad": bad,
                                "engine": engine_label(self.engine),
                                "version": int(self.engine.version)})
            raise Unverified()

    def _verify(self, header: dict[str, Any] | None) -> float | None:
        """Check the engine against the sync's digests: 1.0 match, 0.0 mismatch (weights_ok
        cleared until a sync verifies), None when there is nothing to check with."""
        checked = verifiable(self.engine)
        digests = (header or {}).get("digests")
        self._bad: list[str] = []
        if checked is None or not isinstance(digests, dict):
            return None
        bad = self._bad = checked.verify(digests)
        if bad:
            self.counts["verify_mismatches"] += 1
            log.warning("slot %d: weights v%d differ from the learner's in %d tensors (%s): "
                        "asking for a full sync", self.slot, self.engine.version, len(bad), bad[0])
        self.weights_ok = not bad
        return 0.0 if bad else 1.0
