"""The local rollout engine: a batched, KV-cached sampling decoder over an HF model, in bf16/int8/fp8
(and w4a16, int4 weight-only: the ablation study's declared stress format, qurl.quant.int4).

On CPU machines this is the engine; everywhere it is the numerical reference for what an 8-bit
rollout engine should return. It wraps the HF Qwen2/Llama model loaded from a checkpoint dir and,
for `precision` "int8" / "fp8" (W8A8) or "w4a16" (int4 weights), swaps the seven linears of every
decoder layer (q/k/v/o, gate/up/down) for the quantized modules of `qurl.engines.qlinear`;
embeddings, lm_head, norms, attention math and the KV
cache stay in the full-precision compute `dtype` ("bf16" precision = no quantization at all, weights
in `dtype`; tests use float32 on CPU).

Decoding. A batch of requests is left-padded to a common prompt length; `attention_mask` masks the
pads and `position_ids` count only real tokens, so every row computes exactly what it would alone.
One prefill forward fills an HF `DynamicCache`; then one forward per decode step feeds each row its
last sampled token. Rows stop on EOS / their stop tokens (the stop token is kept in the output, so
the learner trains on emitting it) or at `max_new_tokens`; finished rows are dropped from the batch
and the cache. Sampling (temperature, top-p, greedy, per-request seeds) is `engines/sampling.py`.

Weights and versions. Each sampled token is tagged with the version of the weights whose forward
produced its logits. `between_steps` is called between decode steps; if it calls `load_weights`, the
next tokens are sampled by the new weights and tagged with the new version, while the KV cache of
the tokens already processed is kept although older weights computed it (AReaL's interruptible
generation makes the same trade: recomputing the prefix would cost a prefill per update).

Mixture-of-Experts (Qwen3-MoE, Mixtral). At every precision but w4a16 the sparse MLPs are
qurl/engines/moe_block.py's: the router in full precision, the experts fused as SGLang holds them
(`mlp.experts.w13_weight` / `w2_weight`, int8/fp8 codes with per-expert per-row `_scale`s). Each
result carries `routed_experts` [P + T - 1, L, k] uint8: the experts the engine's own router chose
at every position it forwarded (the prompt's, then one per decode step, each by the weights of
that step: a weight update mid-generation routes the later positions with the new router).

Loading and verifying weights (staged, checked, committed; full and delta chunks; digests) is
qurl/engines/local_weights.py (`LocalWeights`, which `LocalEngine` extends).
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from qurl.engines.local_weights import LocalWeights
from qurl.engines.moe_block import ExpertWeight, RouteSink, install_moe
from qurl.engines.qlinear import QUANT_LINEARS, QuantLinear, fuse_siblings
from qurl.engines.sampling import check_params, request_generator, sample
from qurl.models.hf import load_checkpoint
from qurl.models.moe import check_moe
from qurl.models.moe import family as moe_family
from qurl.types import GenRequest, GenResult

PRECISIONS = ("bf16", "int8", "fp8", "w4a16")
MOE_PRECISIONS = ("bf16", "int8", "fp8")  # qurl/engines/moe_block.py; no int4 experts
LINEAR_KINDS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SIBLINGS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("mlp.gate_proj", "mlp.up_proj"))


def quantize_model_linears(model: nn.Module, fmt: str, fuse: bool = True) -> dict[str, QuantLinear]:
    """Replace the 7 linears of every decoder layer of an HF causal LM by 8-bit modules, in place;
    `fuse`: run each layer's q/k/v and gate/up as one GEMM each (qlinear.Siblings; W8A8 only).

    A MoE layer's MLP has no gate/up/down linears (its experts are qurl/engines/moe_block.py's):
    only its attention linears are replaced here.

    Returns {HF weight name ("model.layers.0.self_attn.q_proj.weight"): module}."""
    out: dict[str, QuantLinear] = {}
    for i, layer in enumerate(model.model.layers):
        for kind in LINEAR_KINDS:
            parent_name, attr = kind.split(".")
            parent = getattr(layer, parent_name)
            if not isinstance(getattr(parent, attr, None), nn.Linear):
                continue  # a MoE layer's mlp
            qmod = QUANT_LINEARS[fmt].from_linear(getattr(parent, attr))
            setattr(parent, attr, qmod)
            out[f"model.layers.{i}.{kind}.weight"] = qmod
        if fuse:  # q/k/v read one input, gate/up another: one quantization and GEMM each
            for group in SIBLINGS:
                mods = [out.get(f"model.layers.{i}.{kind}.weight") for kind in group]
                if all(m is not None for m in mods):
                    fuse_siblings(mods)  # type: ignore[arg-type]
    return out


class LocalEngine(LocalWeights):
    """Engine over a local HF checkpoint, also a VerifiableEngine and an AdoptingEngine
    (qurl/types.py); see the module docstring."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        precision: str = "bf16",
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
        max_batch: int = 256,
        eos_token_ids: Iterable[int] | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.precision, self.dtype, self.max_batch = precision, dtype, max_batch
        self.device = torch.device(device)
        model, tok = load_checkpoint(model_dir, dtype=dtype)
        self.moe = moe_family(model.config) is not None  # Qwen3-MoE or Mixtral
        if self.moe:
            check_moe(model.config)
            if precision not in MOE_PRECISIONS:
                raise ValueError(f"LocalEngine({model_dir}): precision {precision!r} has no MoE "
                                 f"experts; a mixture-of-experts model runs at {', '.join(MOE_PRECISIONS)}")
        self.model = model.to(self.device).requires_grad_(False)  # never trained here
        self.tokenizer = tok
        self._routes: RouteSink | None = None
        experts: dict[str, ExpertWeight] = {}
        if self.moe:
            experts, self._routes = install_moe(self.model, None if precision == "bf16" else precision)
        self._qlinears: dict[str, QuantLinear | ExpertWeight] = (
            quantize_model_linears(self.model, precision) if precision != "bf16" else {}
        )
        self._qlinears.update(experts)
        # name -> live tensor (parameter or buffer); tied lm_head.weight aliases the embedding.
        self._tensors: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        if eos_token_ids is None:
            gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
            ids = set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
            ids.add(tok.eos_token_id)
            eos_token_ids = (i for i in ids if i is not None)
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
        self.vocab_size = int(self.model.config.vocab_size)
        self._gen = torch.Generator().manual_seed(seed)
        self._version = 0
        self.adopted = False  # whether the last load_weights took the chunks' memory as its own
        self._digest: str | None = None  # combined digest of the version verified (None: not)
        self._wire_dtype: dict[str, torch.dtype] = {}  # dtype each tensor was last sent in
        # transformers 5.2x renamed forward's `past_key_values` to `cache` (old name deprecated).
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def version(self) -> int:
        return self._version

    def close(self) -> None:
        """Nothing to release outside this process (Engine protocol)."""

    def names(self) -> list[str]:
        """Every tensor name `load_weights` accepts (8-bit engines: linears also as `<name>_scale`)."""
        return list(self._tensors)

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def token_logits(self, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """Logits predicting each output token, teacher-forced, under the current weights: [T, V] fp32."""
        if not prompt_ids or not output_ids:
            raise ValueError("prompt_ids and output_ids must be non-empty")
        ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0].float()
        p = len(prompt_ids)
        return logits[p - 1 : p - 1 + len(output_ids)].cpu()

    def logprobs(
        self, prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0
    ) -> torch.Tensor:
        """log softmax(logits / T)[token] of each output token: [T] fp32 (T == 0 scores at T = 1)."""
        logits = self.token_logits(prompt_ids, output_ids)
        t = temperature if temperature > 0 else 1.0
        logp = torch.log_softmax(logits / t, dim=-1)
        return logp.gather(1, torch.tensor(output_ids).unsqueeze(1)).squeeze(1)

    # ------------------------------------------------------------------ generation
    def generate(
        self, requests: list[GenRequest], between_steps: Callable[[], None] | None = None
    ) -> list[GenResult]:
        """Sample every request to completion, in batches of at most `max_batch`, in order."""
        for r in requests:
            self._check_request(r)
        results: list[GenResult] = []
        for i in range(0, len(requests), self.max_batch):
            results.extend(self._generate_batch(requests[i : i + self.max_batch], between_steps))
        return results

    def _check_request(self, r: GenRequest) -> None:
        p = r.params
        check_params(r.rid, p.temperature, p.top_p, p.max_new_tokens)
        if not r.prompt_ids:
            raise ValueError(f"request {r.rid}: prompt_ids is empty")
        bad = [t for t in r.prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"request {r.rid}: prompt token id {bad[0]} outside [0, {self.vocab_size})")

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Last-position logits [B, V] fp32, and a MoE's routes of every position [B, S, L, k]
        uint8 (None for a dense model)."""
        if self._routes is not None:
            self._routes.start()
        # logits_to_keep=1: the head (hidden x vocab, 49k rows on real models) runs on the last
        # position only; a prefill would otherwise compute it for every prompt token.
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})
        routes = None if self._routes is None else self._routes.take(*ids.shape)
        return out.logits[:, -1, :].float().cpu(), routes

    @torch.no_grad()
    def _generate_batch(
        self, reqs: list[GenRequest], between_steps: Callable[[], None] | None
    ) -> list[GenResult]:
        from transformers import DynamicCache

        n, plen = len(reqs), max(len(r.prompt_ids) for r in reqs)
        # A group's samples share one prompt: prefill each distinct prompt once, then give every
        # request its own copy of that prompt's KV cache rows (G x less prefill for groups of G).
        unique: dict[tuple[int, ...], int] = {}
        row_of = [unique.setdefault(tuple(r.prompt_ids), len(unique)) for r in reqs]
        ids = torch.full((len(unique), plen), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(unique), plen), dtype=torch.long)
        for prompt, u in unique.items():
            ids[u, plen - len(prompt):] = torch.tensor(prompt)
            mask[u, plen - len(prompt):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = [request_generator(r.params.seed, self._gen) for r in reqs]
        stops = [self.eos_token_ids | set(r.params.stop_token_ids) for r in reqs]
        toks: list[list[int]] = [[] for _ in reqs]
        lps: list[list[float]] = [[] for _ in reqs]
        ents: list[list[float]] = [[] for _ in reqs]
        vers: list[list[int]] = [[] for _ in reqs]
        reasons = ["length"] * n
        active = list(range(n))  # request index of each row of the live batch
        cache = DynamicCache(config=self.model.config)
        dev = self.device
        mask, pos = mask.to(dev), pos.to(dev)
        logits, routes = self._forward(ids.to(dev), mask, pos, cache)
        # routed_experts: each request's prompt positions (pads dropped), then one per decode step
        moe_routes: list[list[torch.Tensor]] | None = None
        if routes is not None:
            moe_routes = [[routes[u, plen - len(r.prompt_ids):]] for u, r in zip(row_of, reqs)]
        if len(unique) < n:
            rows = torch.tensor(row_of)
            cache.batch_select_indices(rows.to(dev))
            logits, mask, pos = logits[rows], mask[rows.to(dev)], pos[rows.to(dev)]
        next_pos = pos[:, -1] + 1
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32)
        top_ps = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32)
        while True:
            rows = torch.tensor(active)
            tokens, logps, entropy = sample(logits, temps[rows], top_ps[rows],
                                            [gens[i] for i in active])
            keep, last = [], []
            for row, (i, tok, lp, h) in enumerate(zip(active, tokens.tolist(), logps.tolist(),
                                                      entropy.tolist())):
                toks[i].append(tok)
                lps[i].append(lp)
                ents[i].append(h)
                vers[i].append(self._version)
                if tok in stops[i]:
                    reasons[i] = "stop"
                elif len(toks[i]) < reqs[i].params.max_new_tokens:
                    keep.append(row)
                    last.append(tok)
            if not keep:
                break
            if between_steps is not None:
                between_steps()
            if len(keep) < len(active):  # drop finished rows from batch and KV cache
                sel = torch.tensor(keep, device=dev)
                cache.batch_select_indices(sel)
                mask, next_pos = mask[sel], next_pos[sel]
                active = [active[r] for r in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step_ids = torch.tensor(last, device=dev).unsqueeze(1)
            logits, routes = self._forward(step_ids, mask, next_pos.unsqueeze(1), cache)
            if moe_routes is not None and routes is not None:
                for row, i in enumerate(active):
                    moe_routes[i].append(routes[row])
            next_pos = next_pos + 1
        return [
            GenResult(
                rid=r.rid, prompt_ids=list(r.prompt_ids),
                output_ids=torch.tensor(toks[i], dtype=torch.int64),
                logprobs=torch.tensor(lps[i], dtype=torch.float32),
                versions=torch.tensor(vers[i], dtype=torch.int64),
                finish_reason=reasons[i], entropy=torch.tensor(ents[i], dtype=torch.float32),
                routed_experts=None if moe_routes is None else torch.cat(moe_routes[i]),
            )
            for i, r in enumerate(reqs)
        ]
