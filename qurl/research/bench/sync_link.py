"""`qurl bench sync --delta --link 10gbit,1gbit,100mbit`: full vs delta sync over a limited link.

The learner's sender (rank 0 of a two-rank gloo WeightGroup) runs in this process, moved into
network namespace node 0; the engine side (a WeightReceiver feeding qurl.research.bench.sync_delta's
bare receiver, which adopts a full version and validates then applies a delta in place, as the
local engine does) runs in a spawned process in node 1. The two are joined by a veth pair that
`tc` shapes to each link in turn (qurl/research/bench/netns.py: tbf on both ends; a `:delay` needs
netem). The weights are qurl.research.bench.sync_delta's engine chunks at Qwen2.5 shapes with RANDOM
values (int8 codes, fp32 scales, bf16 pass-throughs; the cost of a delta depends on how many
elements change, not on their values), v1 = v0 with the given share of each tensor changed.

Per link and shape:
- full: the whole version, already in wire buckets, broadcast + adopted + acked. Measured after
  one set-up sync (which gives the receiver v0); on links of 1 Gbit/s and more twice more, the
  best kept (a slow link's transfer dwarfs any warm-up);
- delta, per flip share: encode v1 against v0 (diff + build the delta chunks) + broadcast +
  validate and apply + ack, and back from v1 to v0 (the same bytes); the better of the two. The
  receiver's digest is checked against the sender's after each pair: a wrong apply fails the bench.
Full bytes do not depend on the flips, so one full sync serves every flip share of a shape.

The link cut (`cut_during_sync`, also tests/test_link_cut.py): mid-way through a full sync the
link goes down (`ip link set down`) for longer than the group's timeout; both sides must fail
within that timeout (plus the gloo wake-up), the receiver must still hold the last version it
verified (digest checked), and after the link is up again a re-formed group's next sync (a delta
against that version) must succeed and verify.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Any

import torch

from qurl.errors import InputError
from qurl.learner.dist import free_port
from qurl.research.bench import netns
from qurl.research.bench.sync_delta import FLIPS, KINDS, Sink, engine_chunks_at, perturb
from qurl.weights.arena import ChunkArena
from qurl.weights.delta import diff_named, encode_named
from qurl.weights.digest import combine, named_digests
from qurl.weights.group import WeightGroup
from qurl.weights.receiver import WeightReceiver
from qurl.weights.sender import WeightSender

LINK_TIMEOUT_S = 120.0  # the bench's group timeout (one bucket's broadcast must fit in it)
CUT_TIMEOUT_S = 10.0  # the group timeout during the link-cut demonstration
FAST_BITS = 1e9  # links at least this fast get two more full syncs (the best kept)


def _receiver(ns: str, ctl: Any, ann_q: Any, ack_q: Any) -> None:
    netns.enter(ns)
    torch.set_num_threads(1)
    sink, group, rec, tmo = Sink(), None, None, LINK_TIMEOUT_S
    ack_q.put("ready")  # imports done: a short group timeout is not spent on them
    while True:
        cmd = ctl.get()
        if cmd[0] == "join":
            host, port, tmo = cmd[1:]
            group = WeightGroup(host, port, 1, 2, "gloo", "qurl_link", timeout_s=tmo)
            rec = WeightReceiver(group, sink)  # type: ignore[arg-type]
            ack_q.put("joined")
        elif cmd[0] == "sync":
            t0 = time.perf_counter()
            try:
                rec.receive(lambda: ann_q.get(timeout=tmo))
                ack_q.put(("ok", time.perf_counter() - t0))
            except Exception as e:  # noqa: BLE001 - reported to the sender
                ack_q.put(("failed", time.perf_counter() - t0, str(e).splitlines()[0][:200]))
        elif cmd[0] == "digest":
            ack_q.put((combine(named_digests(sink.tensors.items())), sink.version))
        elif cmd[0] == "leave":
            if group is not None:
                group.close(abandon=True)
            group = rec = None
            while not ann_q.empty():  # announcements of a sync that failed part-way
                ann_q.get()
            ack_q.put("left")
        elif cmd[0] == "reset":
            sink.tensors = {}
            if rec is not None:
                rec._banks = [[], []]  # free the last shape's memory
            ack_q.put("reset")
        else:
            return


class LinkPair:
    """This process (node 0, the sender) and one receiver process (node 1) over `pair`."""

    def __init__(self, pair: netns.NodePair, bucket_bytes: int, timeout_s: float) -> None:
        self.pair, self.bucket_bytes, self.timeout_s = pair, bucket_bytes, timeout_s
        ctx = mp.get_context("spawn")
        self.ctl, self.ann_q, self.ack_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_receiver, args=(pair.names[1], self.ctl, self.ann_q,
                                                        self.ack_q), daemon=True)
        self.proc.start()
        assert self.ack_q.get(timeout=300) == "ready"
        self.group: WeightGroup | None = None
        self.sender: WeightSender | None = None

    def form(self) -> None:
        self.leave()
        port = free_port()
        self.ctl.put(("join", self.pair.addrs[0], port, self.timeout_s))
        self.group = WeightGroup(self.pair.addrs[0], port, 0, 2, "gloo", "qurl_link",
                                 timeout_s=self.timeout_s)
        self.sender = WeightSender(self.group, bucket_bytes=self.bucket_bytes)
        assert self.ack_q.get(timeout=self.timeout_s) == "joined"

    def leave(self) -> None:
        if self.group is not None:
            self.group.close(abandon=True)
            self.ctl.put(("leave",))
            while self.ack_q.get(timeout=self.timeout_s + 30) != "left":
                pass  # a failed sync's late report
        self.group = self.sender = None

    def sync(self, chunks, version: int, base: tuple[int, str] | None = None) -> float:
        """One sync; seconds on the sender until the receiver acked. Raises if either failed."""
        header = {"mode": "full"} if base is None else \
            {"mode": "delta", "base": list(base), "digests": {}}
        acked: list = []

        def announce(a):
            self.ann_q.put(a.to_dict() if a.index else {**a.to_dict(), "sync": header})
            if not a.last:
                return None

            def wait() -> None:
                acked.append(self.ack_q.get(timeout=self.timeout_s + 30))
                if acked[-1][0] != "ok":
                    raise RuntimeError(f"receiver: {acked[-1][2]}")
            return wait

        self.ctl.put(("sync",))
        t0 = time.perf_counter()
        self.sender.send(chunks, version=version, announce=announce)
        return time.perf_counter() - t0

    def digest(self) -> tuple[str, int]:
        self.ctl.put(("digest",))
        return self.ack_q.get(timeout=600)

    def reset(self) -> None:
        self.ctl.put(("reset",))
        self.ack_q.get(timeout=600)

    def close(self) -> None:
        self.leave()
        self.ctl.put(("stop",))
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def _delta(link: LinkPair, prev: list, nxt: list, version: int, base: tuple[int, str]
           ) -> tuple[float, float, int]:
    """Encode nxt against prev and send it: (encode seconds, sync seconds, wire bytes)."""
    t0 = time.perf_counter()
    before = dict(prev)
    wire, st = encode_named(before, nxt, diff_named(before, nxt))
    enc = time.perf_counter() - t0
    return enc, link.sync(wire, version, base), st.bytes


def _placed(chunks: list, budget: int) -> tuple[ChunkArena, list]:
    arena = ChunkArena(chunks, budget)
    return arena, [(n, arena.views[n].copy_(t)) for n, t in chunks]


def bench_link(links: list[tuple[str, str | None]], shapes: tuple[str, ...],
               flips: tuple[float, ...] = FLIPS, bucket_mb: float = 64.0,
               layers: int | None = None, cut: bool = True) -> list[dict]:
    """Print and return one row per (link, shape, flip share); see the module docstring."""
    budget = int(bucket_mb * 2**20)
    rows: list[dict] = []
    with netns.NodePair() as pair:
        netns.enter(pair.names[0])
        try:
            link = LinkPair(pair, budget, LINK_TIMEOUT_S)
            try:
                for rate, delay in links:
                    pair.shape(rate, delay)
                    label = rate + (f":{delay}" if delay else "")
                    link.form()
                    for shape in shapes:
                        rows += _one_shape(link, label, rate, shape, flips, budget, layers)
                        link.reset()
                if cut:  # at 1 Gbit/s a full 0.5B sync takes seconds: the cut lands mid-way
                    pair.shape("1gbit")
                    c = cut_during_sync(link, engine_chunks_at(shapes[0], layers),
                                        timeout_s=CUT_TIMEOUT_S, cut_after_s=1.0,
                                        cut_for_s=CUT_TIMEOUT_S + 5.0)
                    print_cut(c, f"{shapes[0]}, link 1gbit")
            finally:
                link.close()
        finally:
            netns.leave()
    print_table(rows)
    return rows


def bench_link_spec(spec: str, shapes: tuple[str, ...], flips: tuple[float, ...] = FLIPS,
                    bucket_mb: float = 64.0, layers: int | None = None) -> list[dict]:
    """bench_link from `--link`'s text ('10gbit,1gbit,100mbit:10ms'); InputError (one line:
    the command exits 2) for a bad spec, where namespaces cannot be made, or for a delay where
    the kernel cannot emulate one (tried on a scratch pair before anything is measured)."""
    try:
        links = netns.parse_links(spec)
    except ValueError as e:
        raise InputError(f"--link {spec!r}: {e}") from None
    why = netns.unavailable()
    if why:
        raise InputError(f"--link: {why}")
    for rate, delay in links:
        if delay:
            try:
                with netns.NodePair(tag=f"q{os.getpid() % 100000}p") as probe:
                    probe.shape(rate, delay)
            except RuntimeError as e:
                raise InputError(f"--link {rate}:{delay}: {e}") from None
    return bench_link(links, shapes, flips, bucket_mb, layers)


def _one_shape(link: LinkPair, label: str, rate: str, shape: str, flips: tuple[float, ...],
               budget: int, layers: int | None) -> list[dict]:
    arena0, v0 = _placed(engine_chunks_at(shape, layers), budget)
    d0 = combine(named_digests(v0))
    link.sync(v0, 1)  # set-up: the receiver holds v0
    full_s = [link.sync(v0, 1) for _ in range(3 if netns.rate_bits(rate) >= FAST_BITS else 1)]
    full_bytes = sum(t.numel() * t.element_size() for _, t in v0)
    out = []
    for f in flips:
        fresh = perturb(v0, {k: f for k in KINDS})
        arena1, v1 = _placed(fresh, budget)
        del fresh
        e1, s1, nbytes = _delta(link, v0, v1, 2, (1, d0))
        e2, s2, _ = _delta(link, v1, v0, 1, (2, ""))
        got = link.digest()
        if got != (d0, 1):
            raise RuntimeError(f"{shape} {f:.1%}: the receiver's weights differ from the "
                               "sender's after the delta syncs")
        out.append({"link": label, "shape": shape, "flips": f"{f:.1%}",
                    "full_bytes": full_bytes, "delta_bytes": nbytes, "full_s": min(full_s),
                    "delta_s": min(e1 + s1, e2 + s2), "encode_s": min(e1, e2),
                    "send_s": min(s1, s2), "full_runs": len(full_s)})
        print(f"  {label:<14} {shape:<13} {f:>5.1%}  full {min(full_s):7.2f} s  delta "
              f"{out[-1]['delta_s']:7.2f} s (encode {min(e1, e2):.2f} s)", flush=True)
        del arena1, v1
    del arena0, v0
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'link':<14} {'shape':<13} {'flips':>6} {'full MiB':>9} {'delta MiB':>9} "
          f"{'bytes d/f':>9} {'full s':>7} {'delta s':>7} {'encode s':>8} {'send s':>7} "
          f"{'time d/f':>8} {'send/f':>7} {'full Gbit/s':>11}")
    for r in rows:
        print(f"{r['link']:<14} {r['shape']:<13} {r['flips']:>6} {r['full_bytes'] / 2**20:9.1f} "
              f"{r['delta_bytes'] / 2**20:9.1f} {r['delta_bytes'] / r['full_bytes']:9.3f} "
              f"{r['full_s']:7.2f} {r['delta_s']:7.2f} {r['encode_s']:8.2f} {r['send_s']:7.2f} "
              f"{r['delta_s'] / r['full_s']:8.3f} {r['send_s'] / r['full_s']:7.3f} "
              f"{r['full_bytes'] * 8 / r['full_s'] / 1e9:11.2f}")
    print("full: whole version in wire buckets, broadcast + adopted + acked (best of 3 on links "
          ">= 1 Gbit/s, else 1); delta = encode (diff v1 against v0 + build the delta chunks, on "
          "the sender) + send (broadcast + validate/apply + ack), better of v0->v1 and back; "
          "send/f leaves the encode out; random weights at the named shapes; links: tc tbf on "
          "a veth pair")


def cut_during_sync(link: LinkPair, v0: list, *, timeout_s: float, cut_after_s: float,
                    cut_for_s: float, flip: float = 0.02) -> dict[str, Any]:
    """Cut the link mid-way through a full sync (module docstring). Returns what happened:
    sender/receiver failure seconds and errors, whether the receiver kept v0 (digest), and
    the seconds and outcome of the delta sync after the link came back."""
    old = link.timeout_s
    link.timeout_s = timeout_s
    try:
        link.form()
        d0 = combine(named_digests(v0))
        link.sync(v0, 1)
        v1 = perturb(v0, {k: flip for k in KINDS})
        d1 = combine(named_digests(v1))
        out: dict[str, Any] = {"timeout_s": timeout_s, "cut_after_s": cut_after_s,
                               "cut_for_s": cut_for_s}
        timer = threading.Timer(cut_after_s, link.pair.set_link, (False,))
        t0 = time.perf_counter()
        timer.start()
        try:
            link.sync(v1, 2)
            out["sender"], recv = "completed before the cut", ("ok", None, "ok")
        except Exception as e:  # noqa: BLE001 - the expected outcome
            out["sender"] = str(e).splitlines()[0][:160]
            recv = ("failed", None, "(its error above)") if out["sender"].startswith(
                "receiver:") else link.ack_q.get(timeout=timeout_s + 60)
        out["sender_fail_s"] = time.perf_counter() - t0
        timer.join()
        out["receiver"], out["receiver_fail_s"] = recv[2], recv[1]
        link.leave()
        time.sleep(max(0.0, cut_after_s + cut_for_s - (time.perf_counter() - t0)))
        link.pair.set_link(True)
        out["kept"] = link.digest() == (d0, 1)
        t1 = time.perf_counter()
        link.form()
        out["next_s"] = sum(_delta(link, v0, v1, 2, (1, d0))[:2])
        out["next_form_and_sync_s"] = time.perf_counter() - t1
        out["next_ok"] = link.digest() == (d1, 2)
        return out
    finally:
        link.pair.set_link(True)
        link.timeout_s = old


def print_cut(c: dict[str, Any], what: str) -> None:
    print(f"link cut ({what}): down {c['cut_after_s']} s into a full sync for {c['cut_for_s']} s; "
          f"group timeout {c['timeout_s']} s")
    print(f"  sender failed after {c['sender_fail_s']:.1f} s: {c['sender']}")
    print(f"  receiver failed after {c['receiver_fail_s'] or float('nan'):.1f} s: {c['receiver']}")
    print(f"  receiver kept v1 (digest checked): {c['kept']}; link up, group re-formed, next sync "
          f"(delta v1->v2) {'verified' if c['next_ok'] else 'FAILED'} in {c['next_s']:.2f} s "
          f"({c['next_form_and_sync_s']:.2f} s with the re-form)")
