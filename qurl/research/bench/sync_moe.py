"""`qurl bench sync --moe`: bytes per weight sync on a Qwen3-MoE, full vs delta, experts apart.

On a mixture-of-experts model most of the bytes a sync moves are the experts' (tiny-qwen3-moe:
8 experts per layer hold ~80% of the 8-bit codes), and only the experts the step's tokens were
routed to get a gradient. So the question a delta sync answers on a MoE is: how many bytes do
the experts' codes and scales cost per step, next to the dense tensors'?

This bench answers it from real optimizer steps, not a synthetic perturbation: it runs the
synchronous loop (`qurl.commands.train.train`, deploy.rollout = inline, as
qurl/research/bench/run_flips.py does for the dense model) and observes every weight sync the
product makes (`qurl.weights.publish.WeightSync`: quantize, plan full or delta, load, verify).
Per sync it records, split by `CATEGORIES`,

    full    the bytes of the whole version (what a full 8-bit sync sends): `version_bytes`
    sent    the bytes the product actually sent (delta chunks `#dpos/#dend/#dval` counted to the
            tensor they belong to; a refused or mismatched delta's full resend added): `sent_bytes`
    changed share of elements whose bits changed since the previous version (codes: the flip
            fraction), from a bitwise compare of the two versions

and checks that the sent bytes add up to the run's own `sync/bytes` record (the bench fails
otherwise: its accounting must be the product's). The first sync is full (reason `first`); the
others are deltas when the engine verified the previous version.

Categories of an engine chunk (`chunk_category`; a delta chunk counts to its owner):
- `expert codes`, `expert scales`: a layer's fused experts `mlp.experts.w13_weight` / `w2_weight`
  (8-bit codes, or the experts in full precision at bf16) and their `_scale` / `_scale_inv`;
- `router`: `mlp.gate.weight` (full precision, as SGLang keeps it);
- `dense codes`, `dense scales`: the attention linears q/k/v/o (and a dense MLP's, if any);
- `other`: embeddings, norms, biases, lm_head (full precision pass-throughs).

The pass-throughs go in the dtype the local engine takes (the model's dtype), not bf16 as an
SGLang engine would hold them. Bytes only: on a model this small the sync's time is noise.
"""
from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from qurl.quant.experts import is_fused_expert
from qurl.quant.named import is_quantized_linear
from qurl.weights.delta import changed_positions, delta_owner

CATEGORIES = ("expert codes", "expert scales", "router", "dense codes", "dense scales", "other")
EXPERT = CATEGORIES[:2]
# what the bench trains unless --set says otherwise: the MoE on the default recipe (lr 3e-5,
# UAQ s = 1.5, INT8), on one-digit sums after a short warm start so rewards (hence gradients)
# are not all zero; eval off: only the rollout engine's syncs are observed
DEFAULT_SETS = ("model.base=tiny-qwen3-moe", "rollout.precision=int8", "run.steps=4",
                "run.eval_every=0", "model.warmstart_steps=40", "data.digits=1",
                "data.operands=2", "data.train_size=64", "data.eval_size=8",
                "rollout.prompts_per_step=8", "rollout.group_size=8",
                "rollout.max_new_tokens=16", "deploy.progress=false")


def chunk_category(name: str) -> str:
    """The `CATEGORIES` entry of an engine chunk named `name` (a delta chunk: its owner's)."""
    owner = delta_owner(name)
    base = owner.removesuffix("_scale_inv").removesuffix("_scale")
    scale = base != owner
    if is_fused_expert(base):
        return "expert scales" if scale else "expert codes"
    if owner.endswith(".mlp.gate.weight"):
        return "router"
    if is_quantized_linear(base):
        return "dense scales" if scale else "dense codes"
    return "other"


def chunk_bytes(chunks: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Bytes per category of `chunks` (names and tensors as a sync sends them)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for name, t in chunks:
        out[chunk_category(name)] += t.numel() * t.element_size()
    return out


def changed_fractions(prev: dict[str, torch.Tensor], new: Sequence[tuple[str, torch.Tensor]]
                      ) -> dict[str, float]:
    """Per category: elements whose bits differ between `prev` (by name) and `new` / elements."""
    changed, total = dict.fromkeys(CATEGORIES, 0), dict.fromkeys(CATEGORIES, 0)
    for name, t in new:
        c = chunk_category(name)
        changed[c] += int(changed_positions(prev[name], t).numel())
        total[c] += t.numel()
    return {c: changed[c] / total[c] for c in CATEGORIES if total[c]}


class SyncObserver:
    """Records every sync the rollout engine gets during a run (`WeightSync.push` at `precision`):
    the full version's bytes, the bytes sent (every `_load`, resends included) and the changed
    fractions, each by category. `install` patches the product's class for the run; `remove`
    restores it."""

    def __init__(self, precision: str) -> None:
        self.precision = precision
        self.rows: list[dict[str, Any]] = []
        self._prev: dict[str, torch.Tensor] = {}
        self._sent: list[list[tuple[str, torch.Tensor]]] | None = None
        self._orig: tuple[Any, Any] | None = None

    def install(self) -> None:
        from qurl.weights.publish import WeightSync

        push, load = WeightSync.push, WeightSync._load
        self._orig = (push, load)
        obs = self

        def observed_push(ws, named, engine, version):  # type: ignore[no-untyped-def]
            if engine is None or ws.precision != obs.precision:
                return push(ws, named, engine, version)
            obs._sent = []
            quantize = ws.quantize
            got: list[list[tuple[str, torch.Tensor]]] = []

            def q(named_):  # type: ignore[no-untyped-def]
                chunks, stats = quantize(named_)
                got.append(chunks)
                return chunks, stats

            ws.quantize = q  # this call only: the instance attribute shadows the method
            try:
                stats = push(ws, named, engine, version)
            finally:
                del ws.quantize
            obs.record(version, got[0], obs._sent, stats)
            obs._sent = None
            return stats

        def observed_load(engine, plan):  # type: ignore[no-untyped-def]
            if obs._sent is not None:
                obs._sent.append(list(plan.chunks))
            return load(engine, plan)

        WeightSync.push = observed_push  # type: ignore[method-assign]
        WeightSync._load = staticmethod(observed_load)  # type: ignore[method-assign]

    def remove(self) -> None:
        from qurl.weights.publish import WeightSync

        if self._orig is not None:
            WeightSync.push, WeightSync._load = self._orig[0], staticmethod(self._orig[1])
            self._orig = None

    def record(self, version: int, full: Sequence[tuple[str, torch.Tensor]],
               sent: Sequence[Sequence[tuple[str, torch.Tensor]]], stats: dict[str, float]) -> None:
        """One sync: `full` the version's chunks, `sent` what each load carried, `stats` push's."""
        row: dict[str, Any] = {"version": version, "mode": "delta" if stats.get("sync/delta") else
                               "full", "full": chunk_bytes(full),
                               "sent": dict.fromkeys(CATEGORIES, 0), "loads": len(sent),
                               "sync/bytes": stats.get("sync/bytes")}
        for chunks in sent:
            for c, b in chunk_bytes(chunks).items():
                row["sent"][c] += b
        if sum(row["sent"].values()) != row["sync/bytes"]:
            raise RuntimeError(f"version {version}: bench counted {sum(row['sent'].values())} bytes "
                               f"sent, the sync reported {row['sync/bytes']}")
        row["changed"] = changed_fractions(self._prev, full) if self._prev else {}
        self._prev = {n: t.clone() for n, t in full}  # the arenas are reused two versions on
        self.rows.append(row)


def bench_moe_sync(sets: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Train with `DEFAULT_SETS` + `sets` (`--set KEY=VALUE` overrides) in a temporary run
    directory, observe every engine sync, print one row per sync and return them."""
    from qurl.commands.train import train
    from qurl.config import load_config
    from qurl.errors import InputError
    from qurl.learner.dist import free_port

    stamp = time.strftime("%Y%m%d-%H%M%S")  # a fresh run, also under a kept deploy.dir
    with tempfile.TemporaryDirectory(prefix="qurl-bench-moe-") as tmp:
        # a free rendezvous port: another run on this machine may hold the default one
        cfg = load_config(sets=[*DEFAULT_SETS, f"deploy.dir={tmp}", f"run.name=bench-moe-{stamp}",
                                f"deploy.ranks.port={free_port()}", *sets])
        if cfg.deploy.rollout != "inline":
            raise InputError("--moe: deploy.rollout must be inline (the bench observes the "
                             "in-process sync)")
        obs = SyncObserver(cfg.rollout.precision)
        obs.install()
        try:
            train(cfg)
        finally:
            obs.remove()
        from pathlib import Path

        from qurl.train.metrics_log import read_metrics

        recs = {r["version"]: r for r in read_metrics(Path(cfg.deploy.dir) / cfg.run.name / "metrics.jsonl")
                if r.get("kind") == "train"}
    for row in obs.rows:  # the train record of the step that made this version (none for v0)
        rec = recs.get(row["version"], {})
        row["step_record"] = {k: rec.get(k) for k in ("step", "reward", "grad_norm", "flip_frac",
                                                       "kl_behav_prox")}
    print(f"weight syncs of {cfg.model.base} at {cfg.rollout.precision}, UAQ s = "
          f"{cfg.algo.uaq_scale:g}, lr {cfg.optim.lr:g}, {cfg.run.steps} steps, sync mode "
          f"{cfg.deploy.sync.mode}; sets: {' '.join([*DEFAULT_SETS[1:], *sets])}")
    print_rows(obs.rows)
    return obs.rows


def _kib(b: float) -> str:
    return f"{b / 1024:8.1f}"


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    """The per-sync table (KiB), then the mean over the delta syncs."""
    print(f"{'version':>7} {'mode':>5} {'flips exp':>9} {'flips dense':>11} | "
          + " ".join(f"{c:>13}" for c in CATEGORIES) + f" | {'total':>9} {'sent/full':>9} "
          f"{'experts/sent':>12}")
    for r in rows:
        for what in ("full", "sent"):
            b = r[what]
            total = sum(b.values())
            ch = r["changed"]
            flips = (f"{ch.get('expert codes', float('nan')):9.2%} "
                     f"{ch.get('dense codes', float('nan')):11.2%}") if what == "sent" and ch \
                else f"{'':9} {'':11}"
            tail = (f"{total / sum(r['full'].values()):9.4f} "
                    f"{(b['expert codes'] + b['expert scales']) / max(total, 1):12.3f}"
                    if what == "sent" else f"{'':9} {(b['expert codes'] + b['expert scales']) / total:12.3f}")
            label = r["mode"] if what == "sent" else "(all)"
            print(f"{r['version']:>7} {label:>5} {flips} | "
                  + " ".join(f"{_kib(b[c]):>13}" for c in CATEGORIES) + f" | {_kib(total):>9} {tail}")
    for r in rows:
        rec = r.get("step_record") or {}
        if rec.get("step") is not None:
            print(f"version {r['version']}: made by step {rec['step']} (reward {rec['reward']:.3f}, "
                  f"grad norm {rec['grad_norm']:.3g}, flip_frac {rec['flip_frac']:.4f})")
    deltas = [r for r in rows if r["mode"] == "delta"]
    if deltas:
        mean = {c: sum(r["sent"][c] for r in deltas) / len(deltas) for c in CATEGORIES}
        full = {c: sum(r["full"][c] for r in deltas) / len(deltas) for c in CATEGORIES}
        print(f"mean over {len(deltas)} delta syncs, KiB sent (of full): " + ", ".join(
            f"{c} {mean[c] / 1024:.1f} ({mean[c] / full[c]:.1%})" for c in CATEGORIES if full[c]))
        print(f"mean over {len(deltas)} delta syncs, elements changed: " + ", ".join(
            f"{c} {sum(r['changed'][c] for r in deltas) / len(deltas):.2%}" for c in CATEGORIES
            if c in deltas[0]["changed"]))
        exp = sum(mean[c] for c in EXPERT)
        print(f"expert delta bytes per step: {exp / 1024:.1f} KiB = {exp / sum(full[c] for c in EXPERT):.1%} "
              f"of the experts' full bytes, {exp / sum(mean.values()):.1%} of the bytes sent")
    print("KiB per sync; (all): the whole version, what a full sync sends; the mode row: what the "
          "sync sent (a delta's position + value chunks counted to their tensor); flips: share of "
          "8-bit codes changed since the previous version; experts/sent: the experts' share")


def main(argv: list[str] | None = None) -> int:
    """`python -m qurl.research.bench.sync_moe [--set KEY=VALUE ...] [--out rows.json]`."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m qurl.research.bench.sync_moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    p.add_argument("--out", default="", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    rows = bench_moe_sync(args.sets)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
