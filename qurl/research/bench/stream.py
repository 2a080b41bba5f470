"""Stream throughput benchmark: trajectory batches over loopback TCP, authenticated + validated
versus raw, measured side by side in one run.

Both modes send the same frames (a packed batch of trajectory-like records, ~msg_mb per message)
from a sender (a separate process by default, as a rollout worker is) to a receiver in this process:

  raw   plain PUSH/PULL, zero-copy sends, tensors rebuilt with torch.frombuffer; no MAC, no checks
  auth  qurl's Sender/Receiver: MAC on send, size limits + MAC + replay + full trajectory validation
        + unpacking into Trajectory records on receive — everything the learner pays per message

Python's cyclic GC: a receiver builds a few Trajectory objects and tensor views per trajectory, and
every so often that triggers a full collection that walks every object torch's import left behind
(~0.2 s here). Long-running processes avoid this with `gc.freeze()` after start-up, which moves the
objects alive then out of the collector's sight; the benchmark does the same in both ends (disable
with --no-gc-freeze), and the learner/worker processes should too.

Throughput counts message bytes (all frames) received after the first message (the first absorbs
connection set-up) divided by the time between the first and the last receipt. For reference it
also measures, on one core and without sockets, the MAC alone and the validation+unpack alone, which
shows what bounds the authenticated path, and the fraction of the run the receiver spent checking.
hash_threads (default 4) threads per end hash the MAC pieces; the receiver's payload checks run
while they hash. Usage: `python -m qurl.research.bench.stream --total-mb 2048 [--response-len 8192]`.
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import threading
import time
from typing import Any

import torch
import zmq

from qurl.pipeline.channel import Receiver, Sender
from qurl.pipeline.frames import DTYPES, compute_mac, tensor_frame
from qurl.pipeline.payload import pack_trajectories, unpack_trajectories, validate_packed
from qurl.types import Trajectory

_VOCAB = 151_936  # a Qwen-sized vocabulary, so token ids span realistic values
_MiB = 1 << 20


def make_batch(msg_mb: float, prompt_len: int, response_len: int, seed: int = 0):
    """A packed trajectory batch of about msg_mb MiB: (meta, tensors)."""
    g = torch.Generator().manual_seed(seed)
    per_traj = prompt_len * 8 + response_len * (8 + 4 + 8) + 8 * 5
    n = max(1, int(msg_mb * _MiB) // per_traj)
    prompt = torch.randint(0, _VOCAB, (prompt_len,), generator=g)
    trajs = [
        Trajectory(prompt_uid=f"p{i // 8}", sample_idx=i % 8, prompt_ids=prompt,
                   response_ids=torch.randint(0, _VOCAB, (response_len,), generator=g),
                   behav_logp=-torch.rand(response_len, generator=g),
                   versions=torch.zeros(response_len, dtype=torch.int64),
                   reward=float(i % 2), finish_reason="length")
        for i in range(n)
    ]
    return pack_trajectories(trajs)


def _sender_main(mode: str, endpoint: str, key: bytes, n_msgs: int, msg_mb: float,
                 prompt_len: int, response_len: int, hash_threads: int, gc_freeze: bool) -> None:
    meta, tensors = make_batch(msg_mb, prompt_len, response_len)
    if gc_freeze:
        gc.freeze()
    if mode == "auth":
        with Sender(endpoint, key, name="bench", hwm=4, linger_ms=-1, hash_threads=hash_threads) as s:
            for _ in range(n_msgs):
                s.send("trajectory", meta, tensors)
        return
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(endpoint)
    head = json.dumps({"meta": meta, "tensors": [[k, str(t.dtype)[6:], list(t.shape)]
                                                 for k, t in tensors.items()]})
    frames = [head.encode(), *(tensor_frame(t) for t in tensors.values())]
    for _ in range(n_msgs):
        sock.send_multipart(frames, copy=False)
    sock.close(linger=-1)
    ctx.term()


def _receive(mode: str, n_msgs: int, key: bytes, hash_threads: int, start_sender) -> dict[str, Any]:
    if mode == "auth":
        recv = Receiver("tcp://127.0.0.1:0", key, kinds=("trajectory",), hwm=4, vocab_size=_VOCAB,
                        max_len=1 << 20, hash_threads=hash_threads)
        endpoint, sock = recv.endpoint, None
    else:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 4)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
    join = start_sender(endpoint)
    nbytes, t_first = 0, None
    try:
        for i in range(n_msgs):
            if mode == "auth":
                msg = recv.recv(timeout_ms=60_000)
                if msg is None:
                    raise RuntimeError(f"auth: no message within 60 s after {i} "
                                       f"(rejects: {dict(recv.rejects)})")
                size = msg.nbytes
            else:
                frames = sock.recv_multipart(copy=False)
                specs = json.loads(bytes(frames[0].buffer))["tensors"]
                _ = [torch.frombuffer(f.buffer, dtype=torch.uint8).view(DTYPES[dt]).view(shape)
                     for f, (_, dt, shape) in zip(frames[1:], specs) if len(f.buffer)]
                size = sum(len(f.buffer) for f in frames)
            if i == 0:
                t_first = time.perf_counter()
                busy0 = recv.busy_s if mode == "auth" else 0.0
            else:
                nbytes += size
        elapsed = time.perf_counter() - t_first
    finally:
        join()
        if mode == "auth":
            recv.close()
        else:
            sock.close()
    out = {"MBps": nbytes / elapsed / 1e6, "GiBps": nbytes / elapsed / 2**30, "bytes": nbytes,
           "seconds": elapsed}
    if mode == "auth":
        # busy near 1: the receiver's checks bound the rate; well below 1: the sender or the link do
        out["rejects"] = dict(recv.rejects)
        out["receiver_busy"] = (recv.busy_s - busy0) / elapsed
    return out


def _one_core_reference(msg_mb: float, prompt_len: int, response_len: int, key: bytes) -> dict:
    meta, tensors = make_batch(msg_mb, prompt_len, response_len)
    frames = [tensor_frame(t) for t in tensors.values()]
    nbytes = sum(f.nbytes for f in frames)
    reps = 8
    t0 = time.perf_counter()
    for _ in range(reps):
        compute_mac(frames, key)
    t1 = time.perf_counter()
    for _ in range(reps):
        validate_packed(meta, tensors, vocab_size=_VOCAB, current_version=0, max_len=1 << 20)
        unpack_trajectories(meta, tensors)
    t2 = time.perf_counter()
    return {"mac_MBps": reps * nbytes / (t1 - t0) / 1e6,
            "validate_unpack_MBps": reps * nbytes / (t2 - t1) / 1e6,
            "trajectories_per_msg": len(meta["prompt_uids"]), "msg_bytes": nbytes}


def bench_stream(total_mb: int = 2048, msg_mb: float = 8, *, prompt_len: int = 256,
                 response_len: int = 1024, hash_threads: int = 4, processes: bool = True,
                 gc_freeze: bool = True, verbose: bool = True) -> dict[str, Any]:
    """Measure stream MB/s for raw and authenticated+validated trajectory messages (see module doc).
    Returns {"raw": {...}, "auth": {...}, "auth_over_raw", "one_core": {...}, "config": {...}}."""
    key = b"bench-key-0123456789abcdef"
    if gc_freeze:
        gc.freeze()
    ref = _one_core_reference(msg_mb, prompt_len, response_len, key)
    n_msgs = max(3, round(total_mb * _MiB / ref["msg_bytes"]) + 1)
    spawn = mp.get_context("spawn")
    results: dict[str, Any] = {}
    for mode in ("raw", "auth"):
        args = (mode, None, key, n_msgs, msg_mb, prompt_len, response_len, hash_threads, gc_freeze)

        def start_sender(endpoint: str, args=args):
            a = (args[0], endpoint, *args[2:])
            worker = (spawn.Process(target=_sender_main, args=a, daemon=True) if processes
                      else threading.Thread(target=_sender_main, args=a, daemon=True))
            worker.start()
            return lambda: worker.join(timeout=60)

        results[mode] = _receive(mode, n_msgs, key, hash_threads, start_sender)
    out = {**results, "auth_over_raw": results["auth"]["MBps"] / results["raw"]["MBps"],
           "one_core": ref,
           "config": {"total_mb": total_mb, "msg_mb": msg_mb, "messages": n_msgs,
                      "prompt_len": prompt_len, "response_len": response_len,
                      "hash_threads": hash_threads, "processes": processes, "gc_freeze": gc_freeze}}
    if verbose:
        print(f"stream bench: {n_msgs} messages x {ref['msg_bytes'] / _MiB:.2f} MiB "
              f"({ref['trajectories_per_msg']} trajectories each), loopback tcp, "
              f"sender in a {'process' if processes else 'thread'}, hash_threads={hash_threads}, "
              f"gc_freeze={gc_freeze}")
        print(f"  {'mode':<6}{'MB/s':>10}{'GiB/s':>9}")
        for mode in ("raw", "auth"):
            print(f"  {mode:<6}{results[mode]['MBps']:>10.0f}{results[mode]['GiBps']:>9.2f}")
        print(f"  receiver busy checking {results['auth']['receiver_busy']:.0%} of the auth run")
        print(f"  auth/raw = {out['auth_over_raw']:.2f}; one core, no sockets: MAC "
              f"{ref['mac_MBps']:.0f} MB/s, validate+unpack {ref['validate_unpack_MBps']:.0f} MB/s")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mb", type=int, default=2048)
    ap.add_argument("--msg-mb", type=float, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--hash-threads", type=int, default=4)
    ap.add_argument("--threads", action="store_true", help="sender in a thread, not a process")
    ap.add_argument("--no-gc-freeze", action="store_true", help="leave Python's GC as it is")
    a = ap.parse_args(argv)
    return bench_stream(a.total_mb, a.msg_mb, prompt_len=a.prompt_len, response_len=a.response_len,
                        hash_threads=a.hash_threads, processes=not a.threads,
                        gc_freeze=not a.no_gc_freeze)


if __name__ == "__main__":
    main()
