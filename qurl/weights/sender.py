"""Learner side of a weight sync: engine chunks -> byte buckets -> broadcast (transport only).

One sync of version v, run on learner rank 0 (the quantizing is the caller's: the production
syncs quantize into wire-bucket arenas, arena.py; `quant.named.engine_chunks` is the
lazy form of the same rule, for checkpoints and tests):

    named_weights()  ->  ArenaQuantizer / engine_chunks(fmt)  ->  WeightSender.send:
        plan_buckets(budget)  ->  for each bucket:
        pack into one uint8 buffer -> announce(metadata) -> broadcast(buffer) -> wait for receivers

`named_weights()` yields HF names with UAQ's invariant scaling already in the master weights, so
quantizing them gives exactly the grid the engine computes with. The chunks sent are the ones an
engine loads (see qurl/types.py): for `int8` / `fp8` (per channel) each decoder linear
becomes `<name>` codes [out, in] + `<name>_scale` fp32 [out, 1]; for `fp8_block` (SGLang's `fp8`
method with 128x128 blocks) `<name>` codes + `<name>_scale_inv` fp32 [ceil(out/128), ceil(in/128)];
embeddings, lm_head, norms and biases pass through (cast to `wire_dtype` if set: SGLang engines
hold them in bf16, so sending bf16 halves those bytes); `bf16` quantizes nothing and sends every
floating tensor as bf16; `none` passes chunks through untouched (they are already engine chunks).

Announcements. Before each bucket's broadcast the sender calls `announce(BucketAnnouncement)`;
the announcement carries version, bucket index, `last`, load format and names/dtypes/shapes —
everything a receiver needs to allocate the buffer and rebuild the tensors. The transport of the
announcement is the caller's: the async pipeline sends `ann.to_dict()` on its ZeroMQ control
channel; the SGLang adapter puts the same fields in the body of `POST
/update_weights_from_distributed` (fields `names`, `dtypes`, `shapes`, `load_format`,
`weight_version` — SGLang 0.5.23's UpdateWeightsFromDistributedReqInput). `announce` may return a
function; the sender calls it after the broadcast, to wait for the receivers (the HTTP reply, an
ack) — that wait is the `load` time. A receiver that refuses a bucket (an HTTP 400: no update
session, an unknown group, a bad layout) answers at once and never joins its broadcast, which
would then wait for it until the group's timeout (10 minutes; on NCCL the watchdog kills the
learner first). So when the returned function also has a `poll()` method (raise what a receiver
already reported, else return), the sender calls it while the broadcast is in flight, and the
refusal is raised within `POLL_S`.

Two wire formats, both exactly what SGLang 0.5.23's receiver
(`model_runner_components/weight_updater.py: receive_weights_from_distributed`) does:
`flattened_bucket` — ONE broadcast of the bucket's uint8 buffer (see buckets.py);
`per_tensor` (SGLang's `load_format=None`) — one broadcast per tensor, in the announced order.

Timings per sync (seconds): gather (waiting on the chunks, i.e. the learner's TP gather),
quantize (filled by the caller that quantized), pack (copy into the bucket buffer; none when the chunks are already laid out in one,
see arena.py), send (broadcast), load (waiting for receivers after the
broadcast); plus bytes, buckets, tensors.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from qurl.weights.buckets import Bucket, BucketLayout, bucket_buffer, pack, plan_buckets, timed_items
from qurl.weights.group import WeightGroup

LOAD_FORMATS = ("flattened_bucket", "per_tensor")
POLL_S = 0.005  # how often a broadcast in flight checks the receivers' replies (module docstring)

@dataclass(frozen=True)
class BucketAnnouncement:
    """What receivers must know before bucket `index` of sync `version` is broadcast."""

    version: int
    index: int
    last: bool
    load_format: str
    layout: BucketLayout

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "index": self.index, "last": self.last,
                "load_format": self.load_format, "names": self.layout.names,
                "dtypes": self.layout.dtypes, "shapes": self.layout.shapes}

    @staticmethod
    def from_dict(d: Any) -> "BucketAnnouncement":
        """Validate an announcement received from elsewhere; ValueError names the bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"announcement must be a dict, got {type(d).__name__}")
        for key, typ in (("version", int), ("index", int), ("last", bool), ("load_format", str),
                         ("names", list), ("dtypes", list), ("shapes", list)):
            if not isinstance(d.get(key), typ) or (typ is int and isinstance(d.get(key), bool)):
                raise ValueError(f"announcement field {key!r}: expected {typ.__name__}, "
                                 f"got {d.get(key)!r:.80}")
        if d["load_format"] not in LOAD_FORMATS:
            raise ValueError(f"announcement field 'load_format': {d['load_format']!r} not in "
                             f"{LOAD_FORMATS}")
        if d["version"] < 0 or d["index"] < 0:
            raise ValueError("announcement fields 'version' and 'index' must be >= 0")
        layout = BucketLayout.from_meta(d["names"], d["dtypes"], d["shapes"])
        return BucketAnnouncement(d["version"], d["index"], d["last"], d["load_format"], layout)


@dataclass
class SyncStats:
    version: int
    buckets: int = 0
    packed: int = 0  # buckets copied into a send buffer (0 when the chunks come from an arena)
    staged: int = 0  # arena buckets copied whole from host memory to the group's device
    tensors: int = 0
    bytes: int = 0
    gather_s: float = 0.0
    quantize_s: float = 0.0
    pack_s: float = 0.0
    send_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)  # e.g. pause_s from an engine adapter

    def metrics(self, prefix: str = "sync/") -> dict[str, float]:
        out = {f"{prefix}time_{k}": getattr(self, f"{k}_s")
               for k in ("gather", "quantize", "pack", "send", "load", "total")}
        out.update({f"{prefix}bytes": float(self.bytes), f"{prefix}buckets": float(self.buckets),
                    f"{prefix}packed_buckets": float(self.packed)})
        out.update({f"{prefix}{k}": v for k, v in self.extra.items()})
        return out


Announce = Callable[[BucketAnnouncement], "Callable[[], None] | None"]


def await_broadcast(works: list, waiter: Callable[[], None] | None) -> None:
    """Wait for one bucket's broadcast `works`; when `waiter` has `poll()`, call it meanwhile,
    so a receiver's refusal is raised now rather than after the group timeout."""
    poll = getattr(waiter, "poll", None)
    if poll is not None:
        while not all(w.is_completed() for w in works):
            poll()
            time.sleep(POLL_S)
    for w in works:
        w.wait()


class WeightSender:
    """Rank 0 of a WeightGroup: transport only. `send` buckets and broadcasts engine chunks that
    are already what the engines load (quantized by qurl.weights.arena.ArenaQuantizer, or by
    `engine_chunks`); see the module docstring."""

    def __init__(self, group: WeightGroup, bucket_bytes: int = 64 << 20,
                 load_format: str = "flattened_bucket") -> None:
        if group.rank != 0:
            raise ValueError(f"WeightSender must be rank 0 of the weight group, got rank {group.rank}")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r}: must be one of {LOAD_FORMATS}")
        self.group, self.load_format = group, load_format
        self.bucket_bytes = int(bucket_bytes)
        self._bufs: list[torch.Tensor | None] = [None, None]  # double buffer, see send()

    def _buffer(self, k: int, bucket: Bucket) -> torch.Tensor:
        buf = self._bufs[k]
        if buf is None or buf.numel() < bucket.layout.nbytes or buf.device != self.group.device:
            buf = self._bufs[k] = torch.empty(max(bucket.layout.nbytes, self.bucket_bytes),
                                              dtype=torch.uint8, device=self.group.device)
        return buf

    def _timed_chunks(self, chunks: Iterable[tuple[str, torch.Tensor]], stats: SyncStats
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        waited = [0.0]
        for item in timed_items(chunks, waited):
            stats.gather_s = waited[0]
            yield item
        stats.gather_s = waited[0]

    def send(self, chunks: Iterable[tuple[str, torch.Tensor]], version: int,
             announce: Announce | None = None) -> SyncStats:
        """Bucket and broadcast engine `chunks` as version `version`. Every receiver must be
        told each announcement (via `announce`) and take part in each broadcast.

        Pipelined: bucket i+1 is gathered and packed (into the other of two buffers) while
        bucket i's broadcast is in flight; announcements and broadcasts stay in order."""
        stats = SyncStats(version=version)
        t_start = time.perf_counter()
        inflight: tuple[list, Callable[[], None] | None] | None = None

        def finish(job: tuple[list, Callable[[], None] | None]) -> None:
            works, waiter = job
            t0 = time.perf_counter()
            await_broadcast(works, waiter)
            if self.group.device.type == "cuda":
                torch.cuda.synchronize()  # NCCL work.wait() only orders streams; time the transfer
            t1 = time.perf_counter()
            if waiter is not None:
                waiter()
            stats.send_s += t1 - t0
            stats.load_s += time.perf_counter() - t1

        buckets = plan_buckets(self._timed_chunks(chunks, stats), self.bucket_bytes)
        for index, bucket in enumerate(buckets):
            t0 = time.perf_counter()
            tensors = bucket.tensors
            if self.load_format == "flattened_bucket":
                buf = bucket_buffer(tensors, bucket.layout)  # already in place (sync/arena.py)
                if buf is not None and buf.device != self.group.device:
                    # a host arena's bucket (host.py): one copy onto the device, into
                    # the staging buffer bucket i-1 is not using
                    staging = self._buffer(index % 2, bucket)[:bucket.layout.nbytes]
                    buf = staging.copy_(buf, non_blocking=True)
                    stats.staged += 1
                elif buf is None:
                    tensors = [(n, t.to(self.group.device)) for n, t in tensors]
                    buf = pack(tensors, bucket.layout, out=self._buffer(index % 2, bucket))
                    stats.packed += 1
                payload = [buf]
            else:
                payload = [t.to(self.group.device).contiguous() for _, t in tensors]
            if self.group.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # copies done before NCCL reads them
            stats.pack_s += time.perf_counter() - t0
            if inflight is not None:
                finish(inflight)  # bucket i-1 received and loaded before bucket i is announced
            ann = BucketAnnouncement(version, index, bucket.last, self.load_format, bucket.layout)
            t1 = time.perf_counter()
            waiter = announce(ann) if announce is not None else None
            stats.load_s += time.perf_counter() - t1
            inflight = ([self.group.broadcast_async(p) for p in payload], waiter)
            stats.buckets += 1
            stats.tensors += len(tensors)
            stats.bytes += bucket.layout.nbytes
        if inflight is not None:
            finish(inflight)
        stats.total_s = time.perf_counter() - t_start
        if stats.buckets == 0:
            raise ValueError("send: no tensors to sync")
        return stats

    def sync_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The two staging / packing buffers, on the group's device (host.py)."""
        return {"staging": [b for b in self._bufs if b is not None]}
