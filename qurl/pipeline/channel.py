"""ZeroMQ endpoints of the stream: a Sender (PUSH) and a Receiver (PULL) speaking frames.py messages.

Topology used by qurl: the learner binds a PUSH for prompts and a PULL for trajectories (and a PULL
for control); workers connect the opposite ends. PUSH fans messages out round-robin to connected
workers; PULL fair-queues from all of them.

Back-pressure: a PUSH queues at most SNDHWM messages per peer (plus the peer's RCVHWM and the kernel
socket buffers); beyond that `send` blocks, or with `block=False` / `timeout_ms` returns False and
counts `not_sent`. Multipart messages are atomic: the high-water mark is only checked at message
boundaries, so a message is queued whole or not at all.

Receiver invariants: `recv` never raises for bad peer data. Every message is size-checked,
authenticated (HMAC, shared run key), replay-checked (per sender id, seq must increase; sender ids
carry a random per-process nonce so a restarted worker starts a fresh sequence), kind-checked against
the kinds this receiver accepts, and payload-validated (trajectory and prompt messages) before it is
returned. A failure increments `rejects[reason]`, logs a warning (rate-limited) and the receiver
moves on to the next message. A single frame larger than limits.max_message_bytes is cut by libzmq
itself (ZMQ_MAXMSGSIZE: the peer is disconnected, and reconnects) so it never allocates memory here;
such a frame cannot be counted since it never reaches us.

Caveat: replay state is in memory. After a learner restart an attacker holding captured frames could
replay them once; the learner's in-flight bookkeeping (trajectories for prompts not in flight are
dropped) is the second line of defence.

Sockets are not thread-safe: use each Sender/Receiver from one thread.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq

from qurl.pipeline.payload import unpack_prompt, unpack_trajectories, validate_packed, validate_prompt
from qurl.pipeline.frames import KINDS, Limits, Message, WireError, decode, encode

log = logging.getLogger(__name__)


def _open(sock: zmq.Socket, endpoint: str, bind: bool) -> str:
    """Bind or connect; returns the concrete endpoint (random port resolved for ':0' / ':*')."""
    if not bind:
        sock.connect(endpoint)
        return endpoint
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] in ("0", "*"):
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _pool(threads: int) -> ThreadPoolExecutor | None:
    if threads < 1:
        raise ValueError(f"hash_threads={threads}: must be >= 1")
    return ThreadPoolExecutor(threads, thread_name_prefix="qurl-mac") if threads > 1 else None


def _shutdown(sock: zmq.Socket, ctx: zmq.Context | None, pool: ThreadPoolExecutor | None) -> None:
    if not sock.closed:
        sock.close()
    if ctx is not None:
        ctx.term()  # blocks until queued messages are sent or the socket's linger expires
    if pool is not None:
        pool.shutdown(wait=False)


class _Endpoint:
    """Socket plumbing shared by Sender and Receiver.

    Each endpoint owns a private zmq.Context unless one is passed, and closing it terms that context,
    which waits (up to linger) until queued messages are on the wire. This matters for zero-copy
    sends: libzmq reads the tensors' memory from its I/O thread after send() returned, and at
    interpreter exit pyzmq drops its references to that memory — an un-flushed send would then read
    freed memory. A weakref.finalize hook therefore closes (and flushes) any endpoint still open at
    exit; it is registered after pyzmq's own exit hook, so it runs first. With a shared `context`,
    the caller must term it before exit.
    """

    def __init__(self, sock_type: int, endpoint: str, key: bytes, bind: bool, linger_ms: int,
                 context: zmq.Context | None, hash_threads: int, opts: dict[int, int]):
        if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
            raise ValueError("stream key must be bytes of length >= 16 (the shared run key)")
        self.key = bytes(key)
        own_ctx = zmq.Context(io_threads=1) if context is None else None
        self.sock = (context or own_ctx).socket(sock_type)
        self._pool = _pool(hash_threads)
        self._finalizer = weakref.finalize(self, _shutdown, self.sock, own_ctx, self._pool)
        self.sock.setsockopt(zmq.LINGER, linger_ms)
        for opt, val in opts.items():
            self.sock.setsockopt(opt, val)
        try:
            self.endpoint = _open(self.sock, endpoint, bind)
        except zmq.ZMQError as e:
            self._finalizer()
            raise ValueError(f"cannot {'bind' if bind else 'connect'} {endpoint!r}: {e}") from None

    def close(self, linger_ms: int | None = None) -> None:
        """Close the socket; with an owned context, wait up to linger for queued messages."""
        if linger_ms is not None and not self.sock.closed:
            self.sock.setsockopt(zmq.LINGER, linger_ms)
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Sender(_Endpoint):
    """PUSH end. `send` stamps each message with this sender's id and the next seq, and MACs it.

    Args: endpoint ("tcp://host:port"; ":0" with bind=True picks a free port, see `.endpoint`),
    key (shared run key), bind (learner side binds, workers connect), name (readable part of the
    sender id), hwm (SNDHWM, messages), linger_ms (how long close waits to flush; 0 in tests),
    hash_threads (>1 hashes large frames in parallel), sndbuf (kernel buffer bytes, 0 = OS default).
    """

    def __init__(self, endpoint: str, key: bytes, *, bind: bool = False, name: str = "peer",
                 hwm: int = 1000, linger_ms: int = 1000, context: zmq.Context | None = None,
                 hash_threads: int = 1, sndbuf: int = 0):
        opts = {zmq.SNDHWM: hwm, **({zmq.SNDBUF: sndbuf} if sndbuf else {})}
        super().__init__(zmq.PUSH, endpoint, key, bind, linger_ms, context, hash_threads, opts)
        self.sender_id = f"{name}:{os.getpid()}:{secrets.token_hex(4)}"
        self.seq = 0
        self.sent = 0
        self.not_sent = 0
        self.bytes_sent = 0

    def send(self, kind: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None,
             *, block: bool = True, timeout_ms: int | None = None) -> bool:
        """Send one message. Returns True when queued; False (and counts `not_sent`) when the queue
        is full and block=False, or still full after timeout_ms. The tensors are sent zero-copy:
        do not modify them after the call. Raises ValueError for a message the schema cannot carry."""
        frames = encode(kind, meta, tensors or {}, key=self.key, sender=self.sender_id,
                        seq=self.seq, pool=self._pool)
        flags = 0
        if timeout_ms is not None:
            if not self.sock.poll(timeout_ms, zmq.POLLOUT):
                self.not_sent += 1
                return False
            flags = zmq.NOBLOCK
        elif not block:
            flags = zmq.NOBLOCK
        try:
            self.sock.send_multipart(frames, flags=flags, copy=False)
        except zmq.Again:
            self.not_sent += 1
            return False
        self.seq += 1  # only consumed on success, so seqs on the wire stay gap-free per sender
        self.sent += 1
        self.bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        return True


class Receiver(_Endpoint):
    """PULL end that only ever returns authenticated, fresh, validated messages.

    kinds: the message kinds this endpoint accepts (others count as "unexpected_kind").
    For "trajectory" and "prompt", vocab_size and max_len are required; trajectories are checked
    against `current_version` (set it as the learner's version advances) and returned with
    msg.payload = list[Trajectory]; prompts with msg.payload = PromptTask.
    """

    def __init__(self, endpoint: str, key: bytes, *, bind: bool = True,
                 kinds: tuple[str, ...] = ("control", "ack"), hwm: int = 1000,
                 limits: Limits = Limits(), vocab_size: int | None = None,
                 max_len: int | None = None, max_prompt_len: int | None = None,
                 current_version: int = 0, linger_ms: int = 0,
                 moe: tuple[int, int, int] | None = None,
                 context: zmq.Context | None = None, hash_threads: int = 1, rcvbuf: int = 0):
        if not set(kinds) <= set(KINDS):
            raise ValueError(f"kinds={kinds}: each must be one of {KINDS}")
        if {"trajectory", "prompt"} & set(kinds) and (vocab_size is None or max_len is None):
            raise ValueError("a Receiver accepting trajectory/prompt messages needs vocab_size and "
                             "max_len to validate them")
        opts = {zmq.RCVHWM: hwm, zmq.MAXMSGSIZE: limits.max_message_bytes,
                **({zmq.RCVBUF: rcvbuf} if rcvbuf else {})}
        super().__init__(zmq.PULL, endpoint, key, bind, linger_ms, context, hash_threads, opts)
        self.kinds = tuple(kinds)
        self.limits = limits
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.max_prompt_len = max_prompt_len
        self.moe = moe  # (L, k, E) of a MoE model: trajectories' routed_experts checked against it
        self.current_version = current_version
        self.rejects: Counter[str] = Counter()
        self.received = 0
        self.bytes_received = 0
        self.busy_s = 0.0  # time spent checking messages (MAC, validation, unpacking), not waiting
        self.last_seq: dict[str, int] = {}

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """Next good message, or None if none arrived within timeout_ms (None = wait forever).
        Bad messages inside the window are counted and skipped."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            wait = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self.sock.poll(wait, zmq.POLLIN):
                return None
            frames = self.sock.recv_multipart(copy=False)
            t0 = time.perf_counter()
            try:
                msg = self._accept(frames)
            except WireError as e:
                self._reject(e)
            else:
                self.received += 1
                self.bytes_received += msg.nbytes
                return msg
            finally:
                self.busy_s += time.perf_counter() - t0
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def recv_many(self, max_messages: int, timeout_ms: int = 0) -> list[Message]:
        """Up to max_messages good messages: waits up to timeout_ms for the first, then takes only
        what is already queued."""
        out: list[Message] = []
        msg = self.recv(timeout_ms)
        while msg is not None:
            out.append(msg)
            if len(out) >= max_messages:
                break
            msg = self.recv(0)
        return out

    def _accept(self, frames: list[zmq.Frame]) -> Message:
        msg = decode(frames, key=self.key, limits=self.limits, pool=self._pool,
                     check=self._check_payload)
        # The message is authentic, so its (sender, seq) was really sent once: any later copy is a
        # replay, whether or not this first copy turns out to be valid.
        if msg.seq <= self.last_seq.get(msg.sender, -1):
            raise WireError("replay", f"sender {msg.sender!r} seq {msg.seq} <= "
                                      f"{self.last_seq[msg.sender]} already seen")
        self.last_seq[msg.sender] = msg.seq
        if msg.kind not in self.kinds:
            raise WireError("unexpected_kind", f"{msg.kind!r} not accepted here ({self.kinds})")
        if msg.check_error is not None:
            raise msg.check_error
        return msg

    def _check_payload(self, msg: Message) -> Any:
        """Validate and unpack a typed payload. Runs inside decode, possibly before the MAC has
        verified, so it reads state but never changes it."""
        if msg.kind not in self.kinds:
            return None
        if msg.kind == "trajectory":
            validate_packed(msg.meta, msg.tensors, vocab_size=self.vocab_size,
                            current_version=self.current_version, max_len=self.max_len,
                            max_prompt_len=self.max_prompt_len, moe=self.moe)
            return unpack_trajectories(msg.meta, msg.tensors)
        if msg.kind == "prompt":
            task = unpack_prompt(msg.meta, msg.tensors)
            validate_prompt(task, vocab_size=self.vocab_size,
                            max_len=self.max_prompt_len or self.max_len)
            return task
        return None

    def _reject(self, e: WireError) -> None:
        self.rejects[e.reason] += 1
        n = self.rejects[e.reason]
        if n <= 10 or n & (n - 1) == 0:  # first ten, then powers of two: visible but not a flood
            log.warning("stream %s: rejected message #%d of kind %s: %s", self.endpoint, n,
                        e.reason, e.detail)
