"""Which dense neurons go to which expert, and a router fitted to pick them (MoEfication).

Why. Splitting a dense SwiGLU MLP into E experts and keeping k of them per token keeps k/E of its
neurons. Which k/E matters: consecutive blocks of neurons and a random router keep arbitrary
ones, and the result is not a language model (docs/moe.md). MoEfication (Zhang et al., 2022) keeps
the right ones without retraining: group neurons that fire together into one expert, then fit a
router that predicts, from the MLP's input alone, which groups carry this token's output.

Calibration. Text the project owns (qurl/data/sets/*.jsonl: each question rendered with the
"chat" template, `qurl/data/templates.py`, and the set's reference answer as the assistant turn)
is run through the dense model; each layer's MLP input x [N, H] (the post-attention RMSNorm's
output, gain included: what a Mixtral router reads) is kept. A neuron j's activation on token t
is a[t, j] = silu(gate[j] . x_t) * (up[j] . x_t); the MLP's output is down @ a_t.

The partition (`balanced_partition`). Each neuron's pattern is the column |a[:, j]| [N], scaled to
unit length: two neurons are alike when they are large on the same tokens. Balanced k-means with
cosine similarity groups the I neurons into E clusters of exactly I/E: centroids start at E
neurons drawn by the seeded generator; each round assigns (neuron, cluster) pairs greedily in
order of decreasing similarity, a cluster closing when full (every neuron gets exactly one
cluster, every cluster I/E neurons), then recomputes the centroids; it stops when the assignment
no longer changes or after `iters` rounds. Deterministic given the seed and the activations.

The router (`fit_router`). Expert e's contribution to token t is c[t, e] = ||down_e a_e(t)||: how
much of the residual stream dropping it would remove. The router W [E, H] is the ridge least
squares fit (closed form) of x_t -> c[t, :] / mean_e c[t, e] - 1 (the contributions relative to
the token's mean; a Mixtral router has no bias and softmax ignores a per-token shift), so the
logits W x rank the experts by predicted contribution. Their *scale* decides the renormalised
top-k weights w: the caller multiplies W by `router_scale` (docs/moe.md measures it).

The down refit (`refit_down`, k < E only). Keeping k of E experts drops the others' output, part
of which the kept neurons can carry: with S(t) the experts the fitted router picks for token t and
m_t the mask of their neurons, the new down [H, I] minimises, over the calibration tokens,
sum_t ||D (m_t * a_t) - down a_t||^2 + lam ||D - down||_F^2: the dense MLP's output from the
kept neurons only, shrunk toward the dense down (lam = `ridge` times the mean diagonal of the
masked Gram matrix; closed form). At k = E nothing is dropped and down stays as it is.

Ranking quality (`captured`): the share of the oracle top-k contribution that a router's top-k
set keeps, sum_{e in router top-k} c[t, e] / sum_{e in best k} c[t, e], averaged over tokens
(1.0: the router always picks the k largest).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

SETS = Path(__file__).resolve().parents[1] / "data" / "sets"
# (question field, answer field) of the sets whose answer is a worked solution
_FIELDS = {"gsm8k_test": ("question", "answer"), "math500": ("problem", "solution"),
           "minerva_math": ("problem", "solution")}


def set_texts(tokenizer: Any, name: str, rows: range) -> Iterator[list[int]]:
    """Token ids of rows `rows` of qurl/data/sets/<name>.jsonl, one list per row (tokenized as
    consumed): the question as the "chat" template renders it, then the reference answer as the
    assistant turn, then the tokenizer's EOS (<|im_end|> for SmolLM2). No padding."""
    from qurl.data.templates import render_prompt

    if name not in _FIELDS:
        raise ValueError(f"calibration set {name!r}: expected one of {', '.join(_FIELDS)}")
    lines = (SETS / f"{name}.jsonl").read_text().splitlines()
    if rows.start < 0 or rows.stop > len(lines) or len(rows) == 0:
        raise ValueError(f"rows {rows.start}..{rows.stop}: {name} has {len(lines)} rows")
    q_field, a_field = _FIELDS[name]
    for i in rows:
        row = json.loads(lines[i])
        text = render_prompt(row[q_field], "chat", tokenizer) + row[a_field] + tokenizer.eos_token
        yield tokenizer(text, add_special_tokens=False)["input_ids"]


def take_tokens(seqs: Iterable[list[int]], max_tokens: int, max_len: int = 512
                ) -> list[list[int]]:
    """Sequences (each cut to max_len) in order until `max_tokens` tokens are taken (the last
    one cut)."""
    out, n = [], 0
    for s in seqs:
        s = s[:min(max_len, max_tokens - n)]
        if s:
            out.append(s)
            n += len(s)
        if n >= max_tokens:
            break
    return out


@torch.no_grad()
def mlp_inputs(model: torch.nn.Module, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Every decoder layer's MLP input on the tokens of `seqs` (each run alone, no padding):
    per layer [N, H] fp32, N = total tokens. `model`: an HF Llama/Mixtral causal LM."""
    layers = model.model.layers
    got: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None) or layer.block_sparse_moe
        hooks.append(mlp.register_forward_pre_hook(
            lambda _m, args, i=i: got[i].append(args[0].reshape(-1, args[0].shape[-1]).float())))
    try:
        for s in seqs:
            model(input_ids=torch.tensor([s]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(g) for g in got]


def activations(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU neuron activations silu(x gate^T) * (x up^T): x [N, H], gate/up [I, H] -> [N, I]
    fp32."""
    x = x.float()
    return torch.nn.functional.silu(x @ gate.float().t()) * (x @ up.float().t())


def _balanced_assign(sim: torch.Tensor, size: int) -> torch.Tensor:
    """Each row (neuron) to one column (cluster), `size` rows per column, greedily by decreasing
    similarity: sim [I, E] -> [I] int64."""
    I, E = sim.shape
    order = torch.argsort(sim.reshape(-1), descending=True, stable=True).tolist()
    assign = [-1] * I
    room = [size] * E
    left = I
    for flat in order:
        j, e = divmod(flat, E)
        if assign[j] < 0 and room[e]:
            assign[j] = e
            room[e] -= 1
            left -= 1
            if not left:
                break
    return torch.tensor(assign, dtype=torch.int64)


def balanced_partition(act: torch.Tensor, experts: int, *, seed: int = 0, iters: int = 30
                       ) -> torch.Tensor:
    """Neuron permutation [I] int64 grouping co-activating neurons (module docstring): expert e
    takes neurons perm[e*I/E : (e+1)*I/E] (ascending inside each expert). act: [N, I]."""
    N, I = act.shape
    if experts < 1 or I % experts:
        raise ValueError(f"experts={experts} must be >= 1 and divide the {I} neurons")
    if not torch.isfinite(act).all():
        raise ValueError("calibration activations hold NaN or inf")
    feat = act.abs().float().t().contiguous()  # [I, N]
    feat = feat / feat.norm(dim=1, keepdim=True).clamp_min(1e-12)
    gen = torch.Generator().manual_seed(seed)
    cent = feat[torch.randperm(I, generator=gen)[:experts]]  # [E, N]
    assign = None
    for _ in range(iters):
        new = _balanced_assign(feat @ cent.t(), I // experts)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        onehot = torch.nn.functional.one_hot(assign, experts).t().float()  # [E, I]
        cent = onehot @ feat  # cluster sums; the direction is the mean's
        cent = cent / cent.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return torch.cat([torch.nonzero(assign == e).flatten() for e in range(experts)])


def contributions(act: torch.Tensor, down: torch.Tensor, perm: torch.Tensor, experts: int
                  ) -> torch.Tensor:
    """c[t, e] = ||down_e a_e(t)|| of each expert of partition `perm`: act [N, I], down [H, I],
    perm [I] -> [N, E] fp32."""
    w = act.shape[1] // experts
    cols = perm.reshape(experts, w)
    d = down.float()
    return torch.stack([(act[:, c] @ d[:, c].t()).norm(dim=1) for c in cols], dim=1)


def fit_router(x: torch.Tensor, contrib: torch.Tensor, *, ridge: float = 1e-3) -> torch.Tensor:
    """Least-squares router [E, H] fp32 from MLP inputs x [N, H] to the relative contributions
    contrib [N, E] (module docstring); `ridge` times the mean diagonal of x^T x regularises."""
    if x.shape[0] != contrib.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens, contrib {contrib.shape[0]}")
    x = x.double()
    y = (contrib / contrib.mean(dim=1, keepdim=True).clamp_min(1e-12) - 1).double()
    gram = x.t() @ x
    gram += torch.eye(x.shape[1], dtype=gram.dtype) * (ridge * gram.diagonal().mean())
    return torch.linalg.solve(gram, x.t() @ y).t().float()


def refit_down(act: torch.Tensor, down: torch.Tensor, perm: torch.Tensor, picked: torch.Tensor,
               experts: int, *, ridge: float = 0.3) -> torch.Tensor:
    """Down [H, I] fp32 refitted for the experts each token keeps (module docstring): act [N, I],
    down [H, I], perm [I], picked [N, k] expert ids per token."""
    N, I = act.shape
    owner = torch.empty(I, dtype=torch.int64)
    owner[perm] = torch.arange(I) // (I // experts)  # expert of each neuron
    kept = torch.zeros(N, experts).scatter_(1, picked, 1.0)[:, owner]  # [N, I]
    a = (act * kept).double()
    d0 = down.double()
    gram = a.t() @ a
    lam = ridge * float(gram.diagonal().mean())
    rhs = a.t() @ (act.double() @ d0.t()) + lam * d0.t()
    out = torch.linalg.solve(gram + lam * torch.eye(I, dtype=gram.dtype), rhs).t().float()
    if not torch.isfinite(out).all():
        raise ValueError("down refit is not finite (degenerate calibration activations)")
    return out


def captured(logits: torch.Tensor, contrib: torch.Tensor, top_k: int) -> float:
    """Mean over tokens of the oracle top-k contribution a router's top-k keeps (module
    docstring): logits, contrib [N, E]."""
    picked = contrib.gather(1, logits.topk(top_k, dim=1).indices).sum(1)
    best = contrib.topk(top_k, dim=1).values.sum(1).clamp_min(1e-12)
    return float((picked / best).mean())


@torch.no_grad()
def calibrate(src: str | Path, experts: int, top_k: int, *, seed: int = 0,
              set_name: str = "gsm8k_test", rows: range = range(0, 60), tokens: int = 3000,
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None],
                         dict[str, Any]]:
    """Partition, router and down of every layer of dense Llama checkpoint `src` from its
    activations on `tokens` calibration tokens (module docstring): per layer perm [I] int64,
    router [E, H] fp32 (unscaled) and the refitted down [H, I] fp32 (None at top_k == experts),
    and stats: per layer the captured share of the fitted and of a seeded random router, and the
    median relative error of the MLP output from the kept experts, before and after the refit
    (calibration tokens: in-sample)."""
    from qurl.models.hf import load_checkpoint

    model, tok = load_checkpoint(src, dtype=torch.float32)
    seqs = take_tokens(set_texts(tok, set_name, rows), tokens)
    n = sum(map(len, seqs))
    if n < tokens:
        raise ValueError(f"{set_name} rows {rows.start}..{rows.stop} give {n} < {tokens} tokens")
    xs = mlp_inputs(model, seqs)
    gen = torch.Generator().manual_seed(seed)
    perms, routers, downs = [], [], []
    stats: dict[str, Any] = {"calibration": {"set": set_name, "rows": [rows.start, rows.stop],
                                             "tokens": n},
                             "captured_fitted": [], "captured_random": [],
                             "kept_rel_err": [], "kept_rel_err_refit": []}
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        down = mlp.down_proj.weight
        act = activations(xs[i], mlp.gate_proj.weight, mlp.up_proj.weight)
        perm = balanced_partition(act, experts, seed=seed)
        contrib = contributions(act, down, perm, experts)
        router = fit_router(xs[i], contrib)
        logits = xs[i] @ router.t()
        rand = torch.randn(experts, xs[i].shape[1], generator=gen)
        stats["captured_fitted"].append(round(captured(logits, contrib, top_k), 4))
        stats["captured_random"].append(round(captured(xs[i] @ rand.t(), contrib, top_k), 4))
        refit = None
        if top_k < experts:
            picked = logits.topk(top_k, dim=1).indices
            refit = refit_down(act, down, perm, picked, experts)
            owner = torch.empty_like(perm)
            owner[perm] = torch.arange(len(perm)) // (len(perm) // experts)
            kept = act * torch.zeros(len(act), experts).scatter_(1, picked, 1.0)[:, owner]
            want = act @ down.float().t()
            for key, d in (("kept_rel_err", down.float()), ("kept_rel_err_refit", refit)):
                err = (kept @ d.t() - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-12)
                stats[key].append(round(float(err.median()), 4))
        perms.append(perm)
        routers.append(router)
        downs.append(refit)
    return perms, routers, downs, stats
