"""The mismatch from full distributions: every rollout precision and learner on the same contexts.

Sampling a response costs a decode step per token and tells one token's ρ; a teacher-forced forward
of the same response gives the whole next-token distribution at every position, for a prefill's
cost. So, on a CPU where decoding is the bottleneck: sample the contexts once (responses of the
full-precision engine, `mismatch_collect gen --precision bf16`), then at each response position t

- π_behav(·|t): the log-softmax of qurl's local engine at each precision (`LocalEngine.token_logits`,
  teacher-forced: per-token activation quantization makes it the function decoding computes);
- π_prox(·|t): the Megatron learner's full-vocabulary logits (`MegatronLearner.logits`) in fp32
  and bf16;

and from the pair: the exact KL(π_behav‖π_prox) per position (Σ_v p_b log(p_b/p_p)), and K tokens
drawn from π_behav per position with their ρ — the per-token statistics of qurl.research.studies.mismatch
(mean and p99 of k3, max ρ, ρ > C, by position, by π_prox probability) as a rollout at that
precision would report them on these contexts. What this does not do: each precision's own
continuations (contexts come from one policy; at KL ~1e-2 per token the difference is second order).

    python -m qurl.research.studies.mismatch_exact side --ctx DIR/gen_bf16.pt --side engine:int8
    python -m qurl.research.studies.mismatch_exact side --ctx DIR/gen_bf16.pt --side learner:float32
    python -m qurl.research.studies.mismatch_exact analyse --ctx DIR/gen_bf16.pt --out arms.json

`side` writes DIR/lsm_<side>.pt: log-softmax [N, V] fp32 at the N response positions, row order
= the batch's rows, then positions (every SAVE_EVERY rows and at the end, so a stopped run keeps
what it finished). At 256 responses x 48 tokens a side is 2.4 GB: `analyse` memory-maps the files
and works through CHUNK positions at a time (float64 inside a chunk), so its memory does not grow
with the number of responses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from qurl.research.studies.mismatch import POSITION_EDGES, PROB_EDGES, bucketed, summary

ENGINE_SIDES = ("bf16", "int8", "fp8", "w4a16")
SAVE_EVERY = 16  # rows between checkpoints of a side's file (each save rewrites the whole file)
CHUNK = 512  # positions per float64 block in `analyse`
LEARNER_SIDES = ("float32", "bfloat16")


def exact_kl(lsm_behav: torch.Tensor, lsm_prox: torch.Tensor) -> torch.Tensor:
    """KL(π_behav‖π_prox) per position, float64. lsm_*: [N, V] log-probabilities -> [N].
    Both are renormalised in float64 first: an fp32 log-softmax is off by a constant of ~1e-8 per
    position, which would otherwise enter the KL whole."""
    b, p = torch.log_softmax(lsm_behav.double(), -1), torch.log_softmax(lsm_prox.double(), -1)
    return (b.exp() * (b - p)).sum(-1)


def exact_trunc(lsm_behav: torch.Tensor, lsm_prox: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """P_{v~π_behav}(ρ(v) > cap) per position: [N] float64."""
    b, p = torch.log_softmax(lsm_behav.double(), -1), torch.log_softmax(lsm_prox.double(), -1)
    return (b.exp() * ((p - b) > torch.log(torch.tensor(cap, dtype=torch.float64)))).sum(-1)


def sampled_tokens(lsm_behav: torch.Tensor, lsm_prox: torch.Tensor, k: int,
                   seed: int | torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K tokens per position drawn from π_behav: (behav_logp, prox_logp), each [N, K] float32.
    seed: a seed, or a generator to continue (chunked callers)."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    idx = torch.multinomial(lsm_behav.double().exp(), k, replacement=True, generator=g)
    return lsm_behav.gather(1, idx).float(), lsm_prox.gather(1, idx).float()


def response_rows(ctx: dict) -> list[tuple[int, int, int]]:
    """(row, first response column, last column + 1) of every row of a mismatch_collect batch."""
    out = []
    for b in range(ctx["tokens"].shape[0]):
        cols = ctx["loss_mask"][b].nonzero().flatten()
        out.append((b, int(cols[0]), int(cols[-1]) + 1))
    return out


def _save(parts: list[torch.Tensor], path: Path | None, last: bool) -> None:
    """Write the rows done so far (every SAVE_EVERY rows and at the end), atomically."""
    if path is not None and (last or len(parts) % SAVE_EVERY == 0):
        t = torch.cat(parts)
        tmp = path.with_suffix(".tmp")
        torch.save(t, tmp)
        tmp.replace(path)


def side_logsoftmax(ctx: dict, side: str, model: str, seed: int = 0,
                    save_to: Path | None = None) -> torch.Tensor:
    """[N, V] fp32 log-softmax at the response positions, by the engine or the learner `side`;
    with save_to, the rows done so far are written there after each row."""
    from qurl.models.registry import resolve_base
    from qurl.research.studies.mismatch_collect import study_config

    kind, what = side.split(":")
    rows = response_rows(ctx)
    toks = ctx["tokens"]
    parts = []
    if kind == "engine":
        from qurl.engines.factory import ServerSite, make_engine
        from qurl.weights.settings import SyncSettings

        cfg = study_config(model, what, seed=seed)
        engine = make_engine(cfg.rollout, cfg.sglang, SyncSettings.of(cfg.deploy.sync),
                             resolve_base(model), seed=cfg.run.seed,
                             site=ServerSite.of(cfg.deploy, cfg.run, cfg.algo, cfg.learner))
        for b, s, e in rows:
            logits = engine.token_logits(toks[b, :s].tolist(), toks[b, s:e].tolist())
            parts.append(torch.log_softmax(logits.float(), -1))
            _save(parts, save_to, last=len(parts) == len(rows))
        return torch.cat(parts)
    from qurl.learner.dist import destroy_learner_dist, free_port, init_learner_dist
    from qurl.learner.megatron import MegatronLearner

    cfg = study_config(model, "int8", what, seed)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    init_learner_dist(cfg.learner, 0, 1, ranks=cfg.deploy.ranks, host=cfg.deploy.host)
    try:
        learner = MegatronLearner(resolve_base(model), cfg.model, cfg.algo, cfg.optim, cfg.learner,
                                  total_steps=1, seed=seed, ranks=cfg.deploy.ranks)
        for b, s, e in rows:  # one row at a time: full-vocab logits of a batch are large
            logits = learner.logits(toks[b:b + 1, :e])[0]  # [e, V]; row j predicts token j+1
            parts.append(torch.log_softmax(logits[s - 1:e - 1].float(), -1).cpu())
            _save(parts, save_to, last=len(parts) == len(rows))
    finally:
        destroy_learner_dist()
    return torch.cat(parts)


def analyse(ctx: dict, lsm: dict[str, torch.Tensor], k: int = 64, seed: int = 0,
            cap: float = 2.0) -> list[dict]:
    """One arm per (engine precision, learner dtype) pair present in `lsm` (keys as `side`)."""
    all_rows = response_rows(ctx)
    ends = torch.tensor([e - s for _, s, e in all_rows]).cumsum(0)
    arms = []
    for prec in ENGINE_SIDES:
        for dt in LEARNER_SIDES:
            b, p = lsm.get(f"engine:{prec}"), lsm.get(f"learner:{dt}")
            if b is None or p is None:
                continue
            have = min(b.shape[0], p.shape[0])  # a side stopped early: the rows both finished
            rows = all_rows[:int((ends <= have).sum())]
            n = sum(e - s for _, s, e in rows)
            pos = torch.cat([torch.arange(e - s) for _, s, e in rows])  # [n] response index
            g = torch.Generator().manual_seed(seed)
            kls, truncs, behavs, proxs = [], [], [], []
            for i in range(0, n, CHUNK):  # float64 a block at a time: [CHUNK, V]
                bc, pc = b[i:min(i + CHUNK, n)], p[i:min(i + CHUNK, n)]
                kls.append(exact_kl(bc, pc))
                truncs.append(exact_trunc(bc, pc, cap))
                sb, sp = sampled_tokens(bc, pc, k, g)
                behavs.append(sb)
                proxs.append(sp)
            kl, trunc = torch.cat(kls), torch.cat(truncs)
            behav, prox = torch.cat(behavs), torch.cat(proxs)
            mask = torch.ones_like(behav, dtype=torch.bool)
            adv = torch.ones(behav.shape[0])  # A > 0 everywhere: ACR would widen every ρ > C
            arms.append({
                "precision": prec, "learner": dt, "responses": len(rows), "positions": int(kl.numel()),
                "samples_per_position": k, "kl_exact": float(kl.mean()),
                "kl_exact_p99": float(torch.quantile(kl, 0.99)),
                "trunc_exact": float(trunc.mean()),
                "summary": summary(prox, behav, mask, adv, cap),
                "by_position": bucketed(prox, behav, mask, pos[:, None].expand_as(behav),
                                        POSITION_EDGES, cap),
                "by_prob": bucketed(prox, behav, mask, prox.double().exp(), PROB_EDGES, cap)})
    return arms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qurl.research.studies.mismatch_exact",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("side", "analyse"))
    p.add_argument("--ctx", required=True, type=Path, help="a gen_<precision>.pt of mismatch_collect")
    p.add_argument("--side", help="engine:<bf16|int8|fp8|w4a16> or learner:<float32|bfloat16>")
    p.add_argument("--out", type=Path, help="analyse: the arms' JSON")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not a.ctx.is_file():
        print(f"{a.ctx}: no such file (run qurl.research.studies.mismatch_collect gen first)", file=sys.stderr)
        return 2
    ctx = torch.load(a.ctx)
    d = a.ctx.parent
    if a.stage == "side":
        valid = [f"engine:{x}" for x in ENGINE_SIDES] + [f"learner:{x}" for x in LEARNER_SIDES]
        if a.side not in valid:
            print(f"--side {a.side!r}: expected one of {', '.join(valid)}", file=sys.stderr)
            return 2
        out = d / f"lsm_{a.side.replace(':', '_')}.pt"
        side_logsoftmax(ctx, a.side, a.model, a.seed, save_to=out)
        print(out)
        return 0
    lsm = {f.stem[4:].replace("_", ":", 1): torch.load(f, mmap=True)
           for f in sorted(d.glob("lsm_*.pt"))}
    arms = analyse(ctx, lsm, a.samples, a.seed)
    out = a.out or d / "arms.json"
    context = {"precision": ctx["precision"], "responses": len(response_rows(ctx)),
               "new_tokens": ctx["new_tokens"], "sides": sorted(lsm)}
    out.write_text(json.dumps({"context": context, "arms": arms}, indent=1))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
