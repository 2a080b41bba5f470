"""Wire format of the rollout <-> learner stream: typed, authenticated multipart messages.

A message is one ZeroMQ multipart message:

    frame 0        header, utf-8 JSON: {"schema": SCHEMA_VERSION, "kind", "seq", "sender", "meta",
                   "tensors": [{"name", "dtype", "shape"}, ...]}
    frame 1..n     one raw frame per tensor, in header order: the tensor's bytes, C order, native
                   (little-endian) byte order, no padding — exactly numel * itemsize bytes
    frame n+1      32-byte MAC (below)

Nothing is pickled: the header is JSON and tensors are raw bytes rebuilt with `torch.frombuffer`,
so a received tensor aliases the receive buffer (zero copy). Received tensors are owned by the
message: consumers that want to modify one in place clone it first.

MAC. Tag = HMAC-SHA256(key, DOMAIN || u32 nframes || for each frame: u64 len || digests), where the
digests of a frame are the 32-byte BLAKE3 hashes of each consecutive CHUNK-byte piece of it (none for
an empty frame). Forging a tag needs the key or a BLAKE3 collision, as plain HMAC over the bytes
needs the key or a SHA-256 collision. Why the two-level tag: the data pass is the whole cost of
authentication, and BLAKE3 does it at ~2.5x SHA-256's speed on one core (4.5 vs 1.8 GB/s on the
development machines), while the pieces can be hashed by several threads (blake3 releases the GIL).
That is what lets authentication keep up with a loopback link. Lengths and the frame count are inside
the tag, so bytes cannot move between frames.

Decode order (each failure raises WireError with a reason code, see REASONS):
  size limits -> header JSON -> frame count vs header ("truncated") -> MAC ("bad_mac")
  -> schema version ("bad_schema") -> header fields ("bad_header") -> tensors ("bad_tensor").
The bounded header is parsed before the MAC only to tell truncation apart from forgery; nothing from
an unauthenticated message is used beyond counting its rejection. With a hashing pool, the steps
after the MAC (and the caller's pure payload check) run while the pool hashes, which hides their
cost; their verdict is only released once the MAC verifies, so the classification is unchanged.
Replay detection needs state, so it lives in the receiver (channel.py): per sender, a seq <= the
last accepted one is a replay.
Payload-specific packing and validation (trajectories, prompts) live in payload.py.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import warnings
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from blake3 import blake3

SCHEMA_VERSION = 1
KINDS = ("prompt", "trajectory", "control", "ack")
DOMAIN = b"qurl-wire-mac-v2"  # v2: BLAKE3 piece digests (v1 had SHA-256)
CHUNK = 1 << 20  # bytes per BLAKE3 piece of a frame (the unit of parallel hashing)
MAC_BYTES = 32
_POOL_MIN_BYTES = 64 << 10
REASONS = (
    "bad_mac", "truncated", "bad_schema", "bad_header", "oversized", "bad_tensor", "replay",
    "invalid", "unexpected_kind",
)

# dtype names on the wire. The table is the whole vocabulary: anything else is "bad_tensor".
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_NDIM = 8


class WireError(Exception):
    """A message that must not be used. `reason` is one of REASONS; `detail` says what was wrong."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """Upper bounds a receiver enforces before trusting anything. Exceeding one is "oversized"."""

    max_frames: int = 64  # header + tensors + MAC
    max_header_bytes: int = 1 << 20
    max_message_bytes: int = 512 << 20  # all frames together; also the per-frame transport cap
    max_tensor_elems: int = 1 << 28  # per tensor


@dataclass
class Message:
    """A decoded, authenticated message. tensors alias the receive buffers (do not mutate).
    `payload` is filled by the receiver for typed kinds (list[Trajectory], PromptTask)."""

    kind: str
    seq: int
    sender: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    nbytes: int = 0
    payload: Any = field(default=None, repr=False)
    check_error: WireError | None = field(default=None, repr=False)


# ---------------------------------------------------------------- MAC


def _digest_jobs(frames: Sequence[memoryview]) -> list[memoryview]:
    return [f[i : i + CHUNK] for f in frames for i in range(0, f.nbytes, CHUNK)]


def _digest(piece: memoryview) -> bytes:
    return blake3(piece).digest()


def start_mac(frames: Sequence[memoryview], key: bytes,
              pool: Executor | None = None) -> Callable[[], bytes]:
    """Begin the tag over `frames` (byte memoryviews, MAC frame excluded; see the module docstring)
    and return a function that finishes it. With a `pool`, the large pieces are hashed by its threads
    (blake3 releases the GIL) while the caller does other work until it calls the finisher."""
    jobs = _digest_jobs(frames)
    if pool is not None and len(jobs) > 1:
        # Only big pieces go to the pool: a hand-off costs more than hashing a few KiB here.
        futures = [pool.submit(_digest, j) if j.nbytes >= _POOL_MIN_BYTES else None for j in jobs]
        done = [_digest(j) if f is None else None for j, f in zip(jobs, futures)]
    else:
        futures, done = [None] * len(jobs), None

    def finish() -> bytes:
        if done is None:
            digests = iter(_digest(j) for j in jobs)
        else:
            digests = iter([d if f is None else f.result() for d, f in zip(done, futures)])
        mac = hmac.new(key, DOMAIN + struct.pack("<I", len(frames)), hashlib.sha256)
        for f in frames:
            mac.update(struct.pack("<Q", f.nbytes))
            for _ in range(-(-f.nbytes // CHUNK)):
                mac.update(next(digests))
        return mac.digest()

    return finish


def compute_mac(frames: Sequence[memoryview], key: bytes, pool: Executor | None = None) -> bytes:
    """Tag over `frames`; `pool`, if given, hashes the chunks in parallel (same tag, less time)."""
    return start_mac(frames, key, pool)()


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise ValueError("stream key must be bytes of length >= 16 (the shared run key)")
    return bytes(key)


# ---------------------------------------------------------------- encode


def tensor_frame(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor as a flat byte memoryview, without copying when contiguous."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"stream tensors must be on CPU, got device {t.device}")
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def encode(
    kind: str,
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    key: bytes,
    sender: str,
    seq: int,
    pool: Executor | None = None,
) -> list[bytes | memoryview]:
    """Build the frames of one message. Tensor frames alias the tensors (zero copy): they must not be
    modified until the frames are sent. Raises ValueError for anything the schema cannot carry."""
    key = _check_key(key)
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {KINDS}")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**63:
        raise ValueError(f"seq={seq!r}: must be an int in [0, 2**63)")
    specs, raw = [], []
    for name, t in tensors.items():
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no wire name")
        specs.append({"name": name, "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape)})
        raw.append(tensor_frame(t))
    header = {"schema": SCHEMA_VERSION, "kind": kind, "seq": seq, "sender": sender,
              "meta": meta, "tensors": specs}
    try:
        head = json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:  # non-JSON meta, NaN/inf in meta
        raise ValueError(f"meta of {kind!r} message is not strict JSON: {e}") from None
    frames: list[bytes | memoryview] = [head, *raw]
    frames.append(compute_mac([memoryview(head), *raw], key, pool))
    return frames


# ---------------------------------------------------------------- decode


def _as_view(frame: Any) -> memoryview:
    """A flat byte view of a received frame. zmq.Frame -> its (writable) buffer, zero copy;
    read-only buffers (bytes) are copied once so torch.frombuffer gets writable memory."""
    buf = getattr(frame, "buffer", frame)
    mv = memoryview(buf)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    return mv


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite JSON constant {name}")


def _parse_header(raw: memoryview) -> dict[str, Any]:
    try:
        header = json.loads(bytes(raw).decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise WireError("bad_header", f"header is not utf-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise WireError("bad_header", "header is not a JSON object")
    if not isinstance(header.get("tensors"), list):
        raise WireError("bad_header", "header.tensors is not a list")
    return header


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_fields(header: dict[str, Any]) -> None:
    if header.get("kind") not in KINDS:
        raise WireError("bad_header", f"kind={header.get('kind')!r} is not one of {KINDS}")
    seq = header.get("seq")
    if not _is_int(seq) or not 0 <= seq < 2**63:
        raise WireError("bad_header", f"seq={seq!r} is not an int in [0, 2**63)")
    sender = header.get("sender")
    if not isinstance(sender, str) or not 0 < len(sender) <= 256:
        raise WireError("bad_header", "sender must be a non-empty string of <= 256 chars")
    if not isinstance(header.get("meta"), dict):
        raise WireError("bad_header", "meta is not a JSON object")


def _build_tensor(spec: Any, view: memoryview, limits: Limits) -> tuple[str, torch.Tensor]:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise WireError("bad_header", f"tensor spec {spec!r} lacks a string name")
    name, dname, shape = spec["name"], spec.get("dtype"), spec.get("shape")
    if dname not in DTYPES:
        raise WireError("bad_tensor", f"tensor {name!r}: unknown dtype {dname!r}")
    if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
            or not all(_is_int(d) and d >= 0 for d in shape)):
        raise WireError("bad_tensor", f"tensor {name!r}: bad shape {shape!r}")
    numel = math.prod(shape)
    if numel > limits.max_tensor_elems:
        raise WireError("oversized", f"tensor {name!r}: {numel} elements > {limits.max_tensor_elems}")
    dtype = DTYPES[dname]
    want = numel * dtype.itemsize
    if view.nbytes != want:
        reason = "truncated" if view.nbytes < want else "bad_tensor"
        raise WireError(reason, f"tensor {name!r}: {view.nbytes} bytes, shape/dtype need {want}")
    if numel == 0:
        return name, torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # only bytes-backed views reach here read-only; we copied those
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(view, dtype=torch.uint8)
    if t.data_ptr() % dtype.itemsize:  # libzmq may hand us unaligned slices of its batch buffer
        t = t.clone()
    if dtype == torch.bool and t.numpy().max() > 1:  # a bool byte other than 0/1 is undefined
        raise WireError("bad_tensor", f"tensor {name!r}: bool bytes must be 0 or 1")
    return name, t.view(dtype).view(shape)


def decode(
    frames: Sequence[Any],
    *,
    key: bytes,
    limits: Limits = Limits(),
    pool: Executor | None = None,
    check: Callable[[Message], Any] | None = None,
) -> Message:
    """Authenticate and parse one message (frames: zmq.Frame / bytes / memoryview).
    Raises WireError; never returns a message whose MAC did not verify. No replay check here.

    check(msg), if given, is the payload check (validation, unpacking). It runs while the MAC is
    being computed — on bytes not yet authenticated, so it must have no side effects. Its result
    becomes msg.payload; a WireError it raises is kept in msg.check_error for the caller to raise
    after its own stateful checks (replay), so that every message is classified as if checked in
    the documented order."""
    key = _check_key(key)
    if len(frames) < 2:
        raise WireError("truncated", f"{len(frames)} frame(s); a message has at least header + MAC")
    if len(frames) > limits.max_frames:
        raise WireError("oversized", f"{len(frames)} frames > max_frames={limits.max_frames}")
    views = [_as_view(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > limits.max_message_bytes:
        raise WireError("oversized", f"{total} bytes > max_message_bytes={limits.max_message_bytes}")
    if views[0].nbytes > limits.max_header_bytes:
        raise WireError("oversized", f"header {views[0].nbytes} bytes > {limits.max_header_bytes}")
    header = _parse_header(views[0])
    specs = header["tensors"]
    need = len(specs) + 2
    if len(frames) < need:
        raise WireError("truncated", f"{len(frames)} frames, header declares {need}")
    if len(frames) > need:
        raise WireError("bad_header", f"{len(frames)} frames, header declares {need}")
    tag = views[-1]
    if tag.nbytes != MAC_BYTES:
        raise WireError("truncated", f"MAC frame is {tag.nbytes} bytes, not {MAC_BYTES}")
    finish_mac = start_mac(views[:-1], key, pool)
    # While the pool hashes, parse the rest and run `check`. Both are pure functions of the bytes,
    # so the outcome equals checking after the MAC; only a verified MAC lets any of it out.
    msg, error = None, None
    try:
        msg = _parse_body(header, specs, views, total, limits)
        if check is not None:
            try:
                msg.payload = check(msg)
            except WireError as e:
                msg.check_error = e
    except WireError as e:
        error = e
    if not hmac.compare_digest(finish_mac(), tag):
        raise WireError("bad_mac", "MAC does not verify (wrong key or altered frames)")
    if error is not None:
        raise error
    return msg


def _parse_body(header: dict[str, Any], specs: list, views: list[memoryview], total: int,
                limits: Limits) -> Message:
    if header.get("schema") != SCHEMA_VERSION:
        raise WireError("bad_schema", f"schema={header.get('schema')!r}, expected {SCHEMA_VERSION}")
    _check_fields(header)
    tensors: dict[str, torch.Tensor] = {}
    for spec, view in zip(specs, views[1:-1]):
        name, t = _build_tensor(spec, view, limits)
        if name in tensors:
            raise WireError("bad_header", f"tensor name {name!r} repeated")
        tensors[name] = t
    return Message(kind=header["kind"], seq=header["seq"], sender=header["sender"],
                   meta=header["meta"], tensors=tensors, nbytes=total)
