"""The local engine's MoE sparse MLP: the router in full precision, the experts fused and 8-bit.

What a Qwen3-MoE or Mixtral layer computes (transformers `Qwen3MoeSparseMoeBlock`,
`MixtralSparseMoeBlock`; qurl/models/moe.py), per
token x [H] after the post-attention norm, E experts of width I, top-k:

    p = softmax(W_r x) over all E, in fp32;  S, w = top-k of p;  w /= sum(w) if norm_topk_prob
    (Mixtral: always)
    y = sum_{e in S} w_e * W2_e (silu(Wg_e x) * Wu_e x)

`MoeBlock` keeps transformers' own router module (`mlp.gate`, weight [E, H], in the model's
dtype: SGLang keeps the router unquantized too), so the routing is the family's to the bit, and
records the top-k it picks into a `RouteSink` (the engine's `GenResult.routed_experts`).

`FusedExperts` holds the experts in SGLang's fused layout (qurl/quant/experts.py), as buffers
named like SGLang's parameters:

    w13_weight [E, 2I, H] (expert e: gate rows, then up rows), w2_weight [E, H, I]
    int8 / fp8: codes of those shapes + w13_weight_scale [E, 2I, 1], w2_weight_scale [E, H, 1] fp32

and computes each expert the way a W8A8 linear does (qurl/engines/qlinear.py): the tokens routed
to expert e have their activations quantized per token (dynamically), multiplied with the
expert's codes by an exact 8-bit product (int8: FBGEMM or torch._int_mm, qurl/engines/kernels.py;
fp8: the codes widened to fp32, exact products, or torch._scaled_mm on CUDA sm89+), and scaled by
the activation and weight scales. The per-token scale of a row depends only on that row, so
quantizing x once for every expert (as SGLang's fused MoE kernels do) or once per expert gives the
same codes. At "bf16" precision the experts run in the model's dtype with transformers' ops, so
logits equal transformers' forward. The weighted sum over the k experts is in the model dtype.

`ExpertWeight` is the face one fused weight shows the engine's loader (qurl/engines/local_weights.py
treats it like an 8-bit linear): `quantize` (full precision -> per-expert codes and scales) and
`check_codes` (shape, dtype, finite positive scales, no fp8 NaN) before anything is written.
"""
from __future__ import annotations

import torch
from torch import nn

from qurl.engines.kernels import fbgemm_int8_available, fbgemm_int8_product, fbgemm_pack, int8_matmul
from qurl.engines.kernels import scaled_mm_available
from qurl.quant.experts import W13, W2, quantize_experts
from qurl.quant.formats import code_dtype, fp8_has_nan, quantize_per_token

SCALE = "_scale"


class RouteSink:
    """Collects the top-k expert indices every MoE layer picks during one forward, in layer order."""

    def __init__(self) -> None:
        self._routes: list[torch.Tensor] | None = None

    def start(self) -> None:
        self._routes = []

    def record(self, idx: torch.Tensor) -> None:
        """idx: [N tokens, k] int64 from one layer's router (ignored unless started)."""
        if self._routes is not None:
            self._routes.append(idx.to(torch.uint8).cpu())

    def take(self, batch: int, seq: int) -> torch.Tensor | None:
        """This forward's routes as [batch, seq, L, k] uint8 (None if no layer recorded)."""
        routes, self._routes = self._routes, None
        if not routes:
            return None
        return torch.stack(routes, dim=1).reshape(batch, seq, len(routes), -1)


class FusedExperts(nn.Module):
    """E experts in SGLang's fused layout (module docstring); fmt None = full precision."""

    def __init__(self, E: int, I: int, H: int, fmt: str | None, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.E, self.I, self.H, self.fmt, self.dtype = E, I, H, fmt, dtype
        cdt = dtype if fmt is None else code_dtype(fmt)  # type: ignore[arg-type]
        self.register_buffer(W13, torch.zeros(E, 2 * I, H, dtype=cdt, device=device))
        self.register_buffer(W2, torch.zeros(E, H, I, dtype=cdt, device=device))
        if fmt is not None:
            self.register_buffer(W13 + SCALE, torch.ones(E, 2 * I, 1, device=device))
            self.register_buffer(W2 + SCALE, torch.ones(E, H, 1, device=device))
        self._cache: dict[str, tuple[tuple, list]] = {}  # per weight: (key, per-expert packs)

    @classmethod
    def from_hf(cls, experts: nn.Module, fmt: str | None) -> FusedExperts:
        """From transformers' `Qwen3MoeExperts` / `MixtralExperts` (gate_up_proj [E, 2I, H],
        down_proj [E, H, I])."""
        gu, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        E, two_i, H = gu.shape
        mod = cls(E, two_i // 2, H, fmt, gu.dtype, device=gu.device)
        for name, w in ((W13, gu), (W2, down)):
            if fmt is None:
                getattr(mod, name).copy_(w)
            else:
                codes, scale = quantize_experts(w, fmt)
                getattr(mod, name).copy_(codes)
                getattr(mod, name + SCALE).copy_(scale)
        return mod

    # ------------------------------------------------------------------ compute
    def _packed(self, name: str) -> list:
        """Per-expert FBGEMM packings (int8) or fp32 widenings (fp8) of weight `name`, rebuilt
        when its buffer is written (`_version`) or swapped (`data_ptr`)."""
        w = getattr(self, name)
        key = (w.data_ptr(), w._version)
        hit = self._cache.get(name)
        if hit is None or hit[0] != key:
            packs = [fbgemm_pack(we) for we in w] if self.fmt == "int8" else [w.to(torch.float32)]
            hit = self._cache[name] = (key, packs)
        return hit[1]

    def _product(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, K] full precision -> (x @ W_e^T) [n, rows] fp32 through the W8A8 path."""
        xq, xs = quantize_per_token(x, self.fmt)  # type: ignore[arg-type]
        codes = getattr(self, name)[e]
        if self.fmt == "int8":
            if xq.device.type == "cpu" and fbgemm_int8_available():
                pin = torch.zeros(1, xq.shape[1], dtype=torch.int8)
                pin[0, 0] = 127
                prod = fbgemm_int8_product(xq, self._packed(name)[e], pin)
            else:
                prod = int8_matmul(xq, codes).to(torch.float32)
        elif xq.device.type == "cuda" and scaled_mm_available(xq.device):
            one = torch.ones((), device=xq.device)
            prod = torch._scaled_mm(xq, codes.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        else:
            prod = xq.to(torch.float32) @ self._packed(name)[0][e].t()
        return prod * xs * getattr(self, name + SCALE)[e].t()

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU on x [n, H] -> [n, H] in x.dtype."""
        if self.fmt is None:
            gate, up = nn.functional.linear(x, self.w13_weight[e]).chunk(2, dim=-1)
            return nn.functional.linear(nn.functional.silu(gate) * up, self.w2_weight[e])
        gate, up = self._product(W13, e, x).chunk(2, dim=-1)
        h = (nn.functional.silu(gate) * up).to(x.dtype)
        return self._product(W2, e, h).to(x.dtype)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], idx [N, k] expert indices, weights [N, k] -> [N, H] in x.dtype."""
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            y = self._expert(int(e), x[tok]) * weights[tok, slot, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out


class MoeBlock(nn.Module):
    """A Qwen3-MoE / Mixtral sparse MLP over `FusedExperts`, recording its routes (module
    docstring)."""

    def __init__(self, gate: nn.Module, experts: FusedExperts, sink: RouteSink) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.__dict__["sink"] = sink  # shared by all layers; not a submodule

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, S, H] -> [B, S, H]."""
        lead = hidden.shape
        x = hidden.reshape(-1, lead[-1])
        _, weights, idx = self.gate(x)  # transformers' router: fp32 softmax, top-k, renormalise
        self.sink.record(idx)
        return self.experts(x, idx, weights).reshape(lead)


class ExpertWeight:
    """One fused expert weight (w13 or w2) of a `FusedExperts`, as the loader sees it."""

    def __init__(self, experts: FusedExperts, name: str) -> None:
        self.experts, self.name = experts, name

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.experts, self.name)

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision [E, rows, cols] -> (codes, scale [E, rows, 1]) in the engine's format."""
        return quantize_experts(w, self.experts.fmt)  # type: ignore[arg-type]

    def check_codes(self, codes: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> None:
        """ValueError (naming `name`) unless codes/scale fit this weight; writes nothing."""
        want = tuple(self.weight.shape)
        if tuple(codes.shape) != want or codes.dtype != self.weight.dtype:
            raise ValueError(f"{name}: expected {self.experts.fmt} codes {self.weight.dtype} {want}, "
                             f"got {codes.dtype} {tuple(codes.shape)}")
        if tuple(scale.shape) != (*want[:2], 1) or not torch.is_floating_point(scale):
            raise ValueError(f"{name}{SCALE}: expected float scale {(*want[:2], 1)}, "
                             f"got {scale.dtype} {tuple(scale.shape)}")
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise ValueError(f"{name}{SCALE}: scales must be finite and > 0")
        if self.experts.fmt == "fp8" and fp8_has_nan(codes):
            raise ValueError(f"{name}: fp8 codes contain NaN")


def install_moe(model: nn.Module, fmt: str | None) -> tuple[dict[str, ExpertWeight], RouteSink]:
    """Replace every Qwen3-MoE / Mixtral sparse MLP of an HF causal LM by a `MoeBlock`, in place.

    fmt: None (full precision), "int8" or "fp8". Returns ({HF name of each fused 8-bit weight,
    e.g. "model.layers.0.mlp.experts.w13_weight": its ExpertWeight} (empty at full precision),
    the RouteSink every block records into)."""
    sink, weights = RouteSink(), {}
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if not (hasattr(mlp, "gate") and hasattr(mlp, "experts")):
            raise ValueError(f"model.layers.{i}.mlp: not a sparse MoE block (dense MLP layers "
                             "among MoE layers are unsupported)")
        if int(mlp.experts.gate_up_proj.shape[0]) > 256:  # routes travel as uint8
            raise ValueError(f"model.layers.{i}.mlp: {mlp.experts.gate_up_proj.shape[0]} experts; "
                             "routed_experts holds expert ids as uint8 (at most 256 experts)")
        experts = FusedExperts.from_hf(mlp.experts, fmt)
        layer.mlp = MoeBlock(mlp.gate, experts, sink)
        if fmt is not None:
            for name in (W13, W2):
                weights[f"model.layers.{i}.mlp.experts.{name}"] = ExpertWeight(experts, name)
    return weights, sink
