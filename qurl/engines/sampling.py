"""Token sampling for the local engine: temperature, top-p, greedy, per-request generators.

Semantics (shared with every engine, see qurl/types.py): a token is drawn from
softmax(logits / T), optionally restricted to the smallest set of most likely tokens whose mass
reaches top_p (the nucleus, renormalised); the reported log-prob is that of the *unrestricted*
tempered distribution, log_softmax(logits / T)[token] — what SGLang returns with temperature applied.
T == 0 means greedy: the argmax token (lowest id on ties, as `torch.argmax` and HF `generate`), with
its log-prob under T = 1.

The entropy reported with each token is that of the same unrestricted tempered distribution,
H = -sum_v p_v log p_v over the whole vocabulary (T = 1 for greedy rows): the behaviour policy's
own entropy at the sampled position, which the learner's π_prox entropy is compared with.

Each request samples with its own `torch.Generator` seeded by the request, so what a request draws
does not depend on which other requests share its batch (its logits can still differ in the last
float bits between batch shapes, since GEMM blocking depends on the batch size).
"""
from __future__ import annotations

import torch


def check_params(rid: str, temperature: float, top_p: float, max_new_tokens: int) -> None:
    """Raise ValueError naming the request and the field unless the sampling params are usable."""
    if not temperature >= 0.0:  # also rejects NaN
        raise ValueError(f"request {rid}: temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"request {rid}: top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 1:
        raise ValueError(f"request {rid}: max_new_tokens must be >= 1, got {max_new_tokens}")


def nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs: [B, V], top_p: [B] -> probs restricted to each row's top-p nucleus (unnormalised).

    A token is kept when the mass of strictly more likely tokens is below top_p, so the most likely
    token is always kept and the kept set is the smallest one reaching top_p."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p.unsqueeze(-1)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return torch.where(keep, probs, torch.zeros_like(probs))


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, gens: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits: [B, V] (read in fp32), temperature / top_p: [B] fp32,
    gens: B generators -> (tokens [B] int64, log-probs [B] fp32, entropies [B] fp32, as defined in
    the module docstring).

    Sampling is by inverse CDF: row i draws one uniform u_i from its own generator and takes the
    first token whose cumulative (nucleus-renormalised) probability exceeds u_i, so each request's
    draw depends only on its own generator and its own logits."""
    logits = logits.float()
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / t.unsqueeze(-1), dim=-1)  # greedy rows: T = 1
    probs = logp.exp()
    entropy = torch.special.entr(probs).sum(-1)  # -p log p, 0 where p underflows to 0
    # The nucleus sorts the vocabulary (49k entries on real models: the costliest op of a decode
    # step's sampling), so only rows that ask for top_p < 1 pay for it; the other rows keep every
    # token, exactly what the nucleus with top_p = 1 would give them.
    cut = (top_p < 1).nonzero().squeeze(-1)
    if cut.numel():
        probs[cut] = nucleus(probs[cut], top_p[cut])
    cdf = probs.cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    u = torch.tensor([float(torch.rand((), generator=g)) for g in gens], dtype=cdf.dtype)
    drawn = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(-1), drawn.clamp(max=logits.shape[-1] - 1))
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy


def request_generator(seed: int | None, fallback: torch.Generator) -> torch.Generator:
    """A CPU generator for one request: seeded by `seed`, or by a draw from the engine's `fallback`."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=fallback))
    return torch.Generator().manual_seed(int(seed) % (2**63))
