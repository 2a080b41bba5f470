"""Token sampling for the local engine: temperature, top-p, greedy, per-request generators.

Semantics (shared with every engine, see engines/base.py): a token is drawn from
softmax(logits / T), optionally restricted to the smallest set of most likely tokens whose mass
reaches top_p (the nucleus, renormalised); the reported log-prob is that of the *unrestricted*
tempered distribution, log_softmax(logits / T)[token] — what SGLang returns with temperature applied.
T == 0 means greedy: the argmax token (lowest id on ties, as `torch.argmax` and HF `generate`), with
its log-prob under T = 1.

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


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs: [V] -> [V] restricted to the top-p nucleus (unnormalised; multinomial renormalises).

    A token is kept when the mass of strictly more likely tokens is below top_p, so the most likely
    token is always kept and the kept set is the smallest one reaching top_p."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(descending=True)
    mass_before = sorted_p.cumsum(0) - sorted_p
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
    return torch.where(keep, probs, torch.zeros_like(probs))


def sample_row(
    logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator
) -> tuple[int, float]:
    """logits: [V] (any float dtype, read in fp32) -> (token id, log-prob as defined above)."""
    logits = logits.float()
    if temperature == 0.0:
        tok = int(torch.argmax(logits))
        return tok, float(torch.log_softmax(logits, dim=-1)[tok])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = nucleus(logp.exp(), top_p)
    tok = int(torch.multinomial(probs.cpu(), 1, generator=gen))
    return tok, float(logp[tok])


def request_generator(seed: int | None, fallback: torch.Generator) -> torch.Generator:
    """A CPU generator for one request: seeded by `seed`, or by a draw from the engine's `fallback`."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=fallback))
    return torch.Generator().manual_seed(int(seed) % (2**63))
