"""`qurl bench sync --delta`: full 8-bit sync vs delta sync, bytes and time, side by side in one run.

Setup as `qurl bench sync` (qurl/research/bench/sync.py): this process is the learner's sender (rank 0),
one spawned process the engine side (rank 1) of a two-rank gloo WeightGroup on loopback. The
weights are engine chunks built directly at the shapes of Qwen2.5-0.5B / 1.5B / 7B (HF names;
int8 codes, fp32 per-channel scales, bf16 embeddings / lm_head / norms / biases as an SGLang engine
holds them): no fp32 masters, so the 1.5B shapes fit in this machine's memory with every copy the
sync needs. Values are random; the cost of a delta depends only on how many bits change and where.

Version v1 is v0 with a given share of each kind of chunk changed at random positions (codes
+-1, scales and pass-throughs by one ulp): the synthetic flip fractions (the same share for codes,
scales and pass-throughs), or the shares a real run measured per kind (`--flips-from`, rows
written by qurl/research/bench/run_flips.py: its mean over steps).

Measured, after a warm-up, best of `repeats`, the two modes alternating so load drift hits both:
- full: the whole of v1 in wire buckets (already laid out: qurl/weights/arena.py), broadcast, the
  receiver adopting the buckets as its tensors (as LocalEngine does) and acking;
- delta: encode v1 against v0 on the sender (qurl/weights/delta.py) + broadcast of the delta chunks
  (packed into send buffers) + the receiver validating and applying them in place + ack;
- verify: one digest pass (qurl/weights/digest.py) over the version on each side, which both modes
  pay after every sync (listed apart; the receiver's is measured in its process).
The receiver's final digest is checked against the sender's: the bench fails on a wrong apply.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import time
from typing import Any

import torch

from qurl.learner.dist import free_port
from qurl.weights.arena import ChunkArena
from qurl.weights.delta import (apply_positions, check_delta, delta_nbytes, diff_named, encode_named,
                                group_delta_chunks)
from qurl.weights.digest import combine, named_digests
from qurl.weights.group import WeightGroup
from qurl.weights.receiver import WeightReceiver
from qurl.weights.sender import WeightSender

# name: (hidden, layers, heads, kv_heads, ffn, vocab, tied embeddings)
DELTA_SHAPES = {"qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
                "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
                "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False)}
FLIPS = (0.005, 0.02, 0.05)
KINDS = ("codes", "scales", "pass")


def engine_chunks_at(shape: str, layers: int | None = None, seed: int = 0, meta: bool = False
                     ) -> list[tuple[str, torch.Tensor]]:
    """Engine chunks (int8 codes + fp32 scales, bf16 pass-throughs) at `shape`, random values;
    layers: only the first this many decoder layers (every shape of a layer is exact);
    meta: tensors on the meta device (names, shapes and dtypes only)."""
    hidden, n_layers, heads, kv_heads, ffn, vocab, tied = DELTA_SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    kv = hidden // heads * kv_heads

    def bf16(*s: int) -> torch.Tensor:
        if meta:
            return torch.empty(*s, dtype=torch.bfloat16, device="meta")
        return (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)

    out = [("model.embed_tokens.weight", bf16(vocab, hidden))]
    for i in range(n_layers if layers is None else layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", bf16(hidden)))
        for kind, (o, n), bias in (("self_attn.q_proj", (hidden, hidden), True),
                                   ("self_attn.k_proj", (kv, hidden), True),
                                   ("self_attn.v_proj", (kv, hidden), True),
                                   ("self_attn.o_proj", (hidden, hidden), False),
                                   ("mlp.gate_proj", (ffn, hidden), False),
                                   ("mlp.up_proj", (ffn, hidden), False),
                                   ("mlp.down_proj", (hidden, ffn), False)):
            if meta:
                out.append((p + kind + ".weight", torch.empty(o, n, dtype=torch.int8, device="meta")))
                out.append((p + kind + ".weight_scale", torch.empty(o, 1, device="meta")))
            else:
                out.append((p + kind + ".weight",
                            torch.randint(-127, 128, (o, n), generator=g, dtype=torch.int8)))
                out.append((p + kind + ".weight_scale", torch.rand(o, 1, generator=g) * 1e-3 + 1e-4))
            if bias:
                out.append((p + kind + ".bias", bf16(o)))
            if kind == "self_attn.o_proj":
                out.append((p + "post_attention_layernorm.weight", bf16(hidden)))
    out.append(("model.norm.weight", bf16(hidden)))
    if not tied:
        out.append(("lm_head.weight", bf16(vocab, hidden)))
    return out


def shape_specs(shape: str) -> list[tuple[str, int, int, str]]:
    """(name, numel, itemsize, kind) of every engine chunk at `shape`, without building any."""
    return [(n, t.numel(), t.element_size(), _kind(n, t))
            for n, t in engine_chunks_at(shape, meta=True)]


def bytes_model(shape: str, fracs: dict[str, float]) -> tuple[int, int]:
    """(full bytes, delta bytes) of one sync at `shape` when fracs[kind] of each tensor's
    elements changed: closed form of qurl/weights/delta.py's choice per tensor."""
    full = delta = 0
    for _, numel, item, kind in shape_specs(shape):
        k = int(round(fracs[kind] * numel))
        full += numel * item
        delta += 0 if k == 0 else min(delta_nbytes(k, numel, item), numel * item)
    return full, delta


def print_bytes_table(settings: list[tuple[str, dict[str, float]]],
                      shapes: tuple[str, ...] = tuple(DELTA_SHAPES)) -> list[dict]:
    """Bytes of full vs delta per shape and flip setting, in closed form (no memory needed: the
    7B shapes too)."""
    rows = []
    print(f"{'shapes':<13} {'flips':>10} {'full MiB':>9} {'delta MiB':>9} {'delta/full':>10}")
    for shape in shapes:
        for label, fracs in settings:
            full, delta = bytes_model(shape, fracs)
            rows.append({"shape": shape, "flips": label, "full_bytes": full, "delta_bytes": delta})
            print(f"{shape:<13} {label:>10} {full / 2**20:9.1f} {delta / 2**20:9.1f} "
                  f"{delta / full:10.4f}")
    return rows


def _kind(name: str, t: torch.Tensor) -> str:
    return "codes" if t.dtype == torch.int8 else "scales" if name.endswith("_scale") else "pass"


def perturb(chunks: list[tuple[str, torch.Tensor]], fracs: dict[str, float], seed: int = 1
            ) -> list[tuple[str, torch.Tensor]]:
    """A copy of `chunks` with about fracs[kind] of each tensor's elements changed at random
    positions: codes +-1 (within [-127, 127]), floats by one ulp (their bits + 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in chunks:
        t = t.clone()
        k = int(round(fracs[_kind(name, t)] * t.numel()))
        if k:
            pos = torch.randint(t.numel(), (k,), generator=g)
            flat = t.view(-1)
            if t.dtype == torch.int8:
                step = torch.where(flat[pos] >= 127, -1, 1).to(torch.int8)
                flat[pos] += step
            else:
                bits = flat.view(torch.int16 if t.element_size() == 2 else torch.int32)
                bits[pos] += 1
        out.append((name, t))
    return out


class _Sink:
    """The engine side: adopts a whole version (LocalEngine's path for a full sync), applies a
    delta in place (validated first, as LocalEngine does)."""

    adopts_chunks = True
    # what the engine protocols (qurl/types.py) ask of it besides the weights
    tokenizer, vocab_size, digest, can_verify = None, 0, None, True

    def __init__(self) -> None:
        self.version, self.adopted = 0, False
        self.tensors: dict[str, torch.Tensor] = {}

    def generate(self, requests, between_steps=None):
        raise NotImplementedError("a weight sink does not generate")

    def close(self) -> None:
        pass

    def verify(self, digests: dict[str, str]) -> list[str]:  # marks it delta-capable
        return []

    def load_weights(self, chunks, version: int, adopt: bool = False, base=None) -> None:
        whole, deltas = group_delta_chunks(chunks)
        checked = {n: check_delta(n, self.tensors[n], parts) for n, parts in deltas.items()}
        take = adopt and not deltas and (not self.tensors or whole.keys() == self.tensors.keys())
        for n, t in whole.items():
            if take:
                self.tensors[n] = t
            else:
                self.tensors[n].copy_(t)
        for n, (pos, val) in checked.items():
            apply_positions(self.tensors[n], pos, val)
        self.version, self.adopted = version, take


Sink = _Sink  # the bare receiver qurl/research/bench/sync_link.py reuses


def _receiver(port: int, ctl: Any, ann_q: Any, ack_q: Any) -> None:
    torch.set_num_threads(1)
    group = WeightGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=600)
    sink = _Sink()
    rec = WeightReceiver(group, sink)  # type: ignore[arg-type]
    while True:
        cmd = ctl.get()
        if cmd[0] == "sync":
            rec.receive(lambda: ann_q.get(timeout=600))
            ack_q.put("sync")
        elif cmd[0] == "digest":
            t0 = time.perf_counter()
            d = combine(named_digests(sink.tensors.items()))
            ack_q.put((d, time.perf_counter() - t0))
        elif cmd[0] == "reset":
            sink.tensors, rec._banks = {}, [[], []]  # free the last shape's memory
            ack_q.put("reset")
        else:
            group.close()
            return


def _mean_fracs(path: str) -> dict[str, float]:
    rows = json.loads(open(path).read())
    return {"codes": sum(r["codes"] for r in rows) / len(rows),
            "scales": sum(r["scales"] for r in rows) / len(rows),
            "pass": sum(r["pass_bf16"] for r in rows) / len(rows)}


def flip_settings(flips: tuple[float, ...], flips_from: tuple[str, ...]
                  ) -> list[tuple[str, dict[str, float]]]:
    out = [(f"{f:.1%}", {k: f for k in KINDS}) for f in flips]
    for path in flips_from:
        out.append((path.rsplit("/", 1)[-1].removesuffix(".json"), _mean_fracs(path)))
    return out


def bench_delta(shapes: tuple[str, ...] = ("qwen2.5-0.5b", "qwen2.5-1.5b"),
                flips: tuple[float, ...] = FLIPS, flips_from: tuple[str, ...] = (),
                bucket_mb: float = 64.0, repeats: int = 3, layers: int | None = None) -> list[dict]:
    """Print and return one row per (shape, flip setting); see the module docstring. The same
    bench over tc-shaped links is qurl/research/bench/sync_link.py, the sender's encode alone (old vs new
    code) qurl/research/bench/sync_encode.py; `qurl bench sync --delta` picks one by its flags."""
    settings = flip_settings(flips, flips_from)
    print("bytes per sync, closed form (qurl.research.bench.sync_delta.bytes_model):")
    print_bytes_table(settings)
    print("measured:")
    ctx = mp.get_context("spawn")
    ctl, ann_q, ack_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_receiver, args=(port, ctl, ann_q, ack_q), daemon=True)
    proc.start()
    budget = int(bucket_mb * 2**20)
    rows: list[dict] = []
    try:
        group = WeightGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=600)
        sender = WeightSender(group, bucket_bytes=budget)

        def announce(a):
            ann_q.put(a.to_dict() if a.index else {**a.to_dict(), "sync": header[0]})
            return (lambda: ack_q.get(timeout=600)) if a.last else None

        header: list[dict] = [{"mode": "full"}]

        def sync(chunks, base: tuple[int, str] | None) -> float:
            header[0] = {"mode": "full"} if base is None else \
                {"mode": "delta", "base": list(base), "digests": {}}
            ctl.put(("sync",))
            t0 = time.perf_counter()
            sender.send(chunks, version=1, announce=announce)
            return time.perf_counter() - t0

        for shape in shapes:
            v0 = engine_chunks_at(shape, layers)
            n_params = sum(t.numel() for n, t in v0 if not n.endswith("_scale"))
            arena0 = ChunkArena(v0, budget)
            placed0 = [(n, arena0.views[n].copy_(t)) for n, t in v0]
            del v0
            for label, fracs in settings:
                v1 = perturb(placed0, fracs)
                arena1 = ChunkArena(v1, budget)
                placed1 = [(n, arena1.views[n].copy_(t)) for n, t in v1]
                del v1
                versions = (placed0, placed1)
                sync(placed0, None)  # the receiver holds v0
                full_s, delta_s, enc_s, diff_s = [], [], [], []
                holds, nbytes = 0, {}
                for r in range(repeats + 1):  # the first round is a warm-up
                    for mode in ("full", "delta"):
                        nxt = 1 - holds
                        t0 = time.perf_counter()
                        if mode == "full":
                            s = sync(versions[nxt], None)
                            nbytes["full"] = sum(t.numel() * t.element_size()
                                                 for _, t in versions[nxt])
                        else:
                            prev = dict(versions[holds])
                            pos = diff_named(prev, [(n, t) for n, t in versions[nxt]
                                                    if t.dtype == torch.int8])
                            d = time.perf_counter() - t0  # the codes' compare: paid by full too
                            pos.update(diff_named(prev, [(n, t) for n, t in versions[nxt]
                                                         if t.dtype != torch.int8]))
                            wire, st = encode_named(prev, versions[nxt], pos)
                            e = time.perf_counter() - t0
                            s = e + sync(wire, (holds, ""))
                            nbytes["delta"], changed = st.bytes, st
                            if r:
                                enc_s.append(e)
                                diff_s.append(d)
                        if r:
                            (full_s if mode == "full" else delta_s).append(s)
                        holds = nxt
                t0 = time.perf_counter()
                want = combine(named_digests(versions[holds]))
                send_digest_s = time.perf_counter() - t0
                ctl.put(("digest",))
                got, recv_digest_s = ack_q.get(timeout=600)
                if got != want:
                    raise RuntimeError(f"{shape} {label}: the receiver's weights differ from the "
                                       "sender's after the delta syncs")
                rows.append({"shape": shape, "params": n_params, "flips": label, **{
                    f"frac_{k}": v for k, v in fracs.items()},
                    "full_bytes": nbytes["full"], "delta_bytes": nbytes["delta"],
                    "full_s": min(full_s), "delta_s": min(delta_s), "encode_s": min(enc_s),
                    "diff_codes_s": min(diff_s),
                    "digest_send_s": send_digest_s, "digest_recv_s": recv_digest_s,
                    "tensors_delta": changed.delta, "tensors_full": changed.full,
                    "tensors_same": changed.same})
                _print_row(rows[-1])
                del arena1, placed1, versions
            del arena0, placed0
            ctl.put(("reset",))
            ack_q.get(timeout=600)
        ctl.put(("stop",))
        group.close()
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    print_legend()
    return rows


def _print_row(r: dict) -> None:
    if not getattr(_print_row, "head", False):
        print(f"{'shapes':<13} {'params':>6} {'flips':>8} {'full MiB':>9} {'delta MiB':>9} "
              f"{'bytes d/f':>9} {'full s':>7} {'delta s':>7} {'encode s':>8} {'codes cmp s':>11} "
              f"{'time d/f':>8} {'(d-cmp)/f':>9} {'verify s send/recv':>18}", flush=True)
        _print_row.head = True  # type: ignore[attr-defined]
    print(f"{r['shape']:<13} {r['params'] / 1e9:5.2f}B {r['flips']:>8} "
          f"{r['full_bytes'] / 2**20:9.1f} {r['delta_bytes'] / 2**20:9.1f} "
          f"{r['delta_bytes'] / r['full_bytes']:9.3f} {r['full_s']:7.3f} {r['delta_s']:7.3f} "
          f"{r['encode_s']:8.3f} {r['diff_codes_s']:11.3f} {r['delta_s'] / r['full_s']:8.3f} "
          f"{(r['delta_s'] - r['diff_codes_s']) / r['full_s']:9.3f} "
          f"{r['digest_send_s']:9.3f}/{r['digest_recv_s']:.3f}", flush=True)


def print_legend() -> None:
    print("full: whole v1, already in wire buckets, broadcast + adopted by the receiver + ack; "
          "delta: encode (compare v1 with v0 bit for bit, qurl/weights/delta.py diff_named, then "
          "build the delta chunks) + broadcast + validate and apply in place + ack; codes cmp: "
          "the part of encode comparing the 8-bit codes, which a qurl full sync pays too (the "
          "flip fraction is counted from it); (d-cmp)/f: the delta's time without it; verify: "
          "one digest pass per side, paid by both modes")


if __name__ == "__main__":
    bench_delta()
