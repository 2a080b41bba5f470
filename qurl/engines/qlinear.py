"""8-bit linear layers (W8A8) for the local rollout engine: real int8 GEMMs, FP8 E4M3 GEMMs.

A W8A8 linear `y = x W^T + b` with `W: [out, in]` holds
- `weight`: 8-bit codes `[out, in]` (int8 or float8_e4m3fn), per output channel symmetric,
- `weight_scale`: fp32 `[out, 1]`, so `W ~= weight * weight_scale`,
- `bias`: full precision `[out]` or None (Qwen2's q/k/v biases),
the layout SGLang's `w8a8_int8` / per-channel `fp8` methods hold and `qurl.quant.named` produces.
At run time every token's activation row is quantized dynamically (`quantize_per_token`:
`x ~= xq * x_scale`, `x_scale: [M, 1]`), and

    y = (xq @ weight^T) * x_scale * weight_scale^T + bias

where the product of codes is computed by an 8-bit kernel (kernels.py):
- INT8: an exact int8 x int8 -> int32 GEMM (no dequantize-then-float), by `torch._int_mm` or
  FBGEMM (`Int8Linear.backend`; FBGEMM is the CPU default where it is exact): kernels.py.
  The int32 sum cannot overflow for K < 2^31 / 127^2 ~ 133k.
- FP8: `torch._scaled_mm` (unit tensor-wise scales, fp32 output) on CUDA devices with an FP8 GEMM
  (sm89+, probed once per device). Elsewhere (CPU) an *exact emulation*:
  the codes are widened to fp32 (every E4M3 value is exactly representable) and multiplied in fp32.
  Products of two E4M3 values have <= 8 significant bits, so each product is exact in fp32 and the
  only difference to a hardware FP8 GEMM (which also accumulates in fp32) is summation order.
  Both paths quantize activations identically, so they sample from the same distribution.

Invariants: codes and scales are buffers (not parameters: nothing trains them) named so that the
module's state_dict keys are the HF names + `_scale`; `load_codes` validates dtype and shape before
writing anything; output dtype equals the input dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from qurl.engines.kernels import (fbgemm_int8_available, fbgemm_int8_product, fbgemm_pack,
                                  int8_matmul, scaled_mm_available)
from qurl.quant.formats import code_dtype, fp8_has_nan, quantize_per_channel, quantize_per_token
from qurl.quant.int4 import (check_int4_codes, dequantize_int4_groups, int4_group,
                             quantize_int4_groups)


class QuantLinear(nn.Module):
    """Shared body of the W8A8 linears: codes [out, in], fp32 scale [out, 1], optional bias [out]."""

    fmt: str = ""

    def __init__(self, in_features: int, out_features: int, bias: bool, bias_dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        cdt = code_dtype(self.fmt)  # type: ignore[arg-type]
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=cdt, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "QuantLinear":
        """Quantize an nn.Linear per output channel into a new module of this class."""
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  w.dtype, device=w.device)
        mod.load_codes(*mod.quantize(w))
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach())
        return mod

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A full-precision weight [out, in] -> (codes, scale) in this layer's format."""
        return quantize_per_channel(w, self.fmt)  # type: ignore[arg-type]

    def check_codes(self, codes: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> None:
        """Raise ValueError (naming `name`) unless codes/scale fit this layer; writes nothing."""
        want = (self.out_features, self.in_features)
        if tuple(codes.shape) != want or codes.dtype != self.weight.dtype:
            raise ValueError(
                f"{name}: expected {self.fmt} codes {self.weight.dtype} {want}, "
                f"got {codes.dtype} {tuple(codes.shape)}"
            )
        if tuple(scale.shape) != (self.out_features, 1) or not torch.is_floating_point(scale):
            raise ValueError(
                f"{name}_scale: expected float scale ({self.out_features}, 1), "
                f"got {scale.dtype} {tuple(scale.shape)}"
            )
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise ValueError(f"{name}_scale: scales must be finite and > 0")
        if self.fmt == "fp8" and fp8_has_nan(codes):
            raise ValueError(f"{name}: fp8 codes contain NaN")

    @torch.no_grad()
    def load_codes(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """Replace the weight by `codes` [out, in] and `scale` [out, 1] (validated first)."""
        self.check_codes(codes, scale)
        self.weight.copy_(codes)
        self.weight_scale.copy_(scale.to(torch.float32))

    def _code_product(self, xq: torch.Tensor) -> torch.Tensor:  # [M, in] codes -> [M, out] fp32
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out] in x.dtype."""
        group = self.__dict__.get("_siblings")
        if group is not None:
            return group[0].output(group[1], x)
        return self._own_forward(x)

    def _own_forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        xq, xs = quantize_per_token(x2, self.fmt)  # type: ignore[arg-type]
        y = self._code_product(xq) * xs * self.weight_scale.t()
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}, bias={self.bias is not None}"


class Int8Linear(QuantLinear):
    """W8A8 INT8 linear: int8 per-channel weights, per-token dynamic int8 activations, an exact
    int8 GEMM. `backend` ("auto" | "int_mm" | "fbgemm"): "auto" takes FBGEMM on CPU where
    `fbgemm_int8_available()`, else `torch._int_mm`. The FBGEMM packing of the codes is cached,
    keyed on the weight buffer's storage and version counter (any new codes invalidate it)."""

    fmt = "int8"
    backend: str = "auto"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed: tuple[tuple[int, int], object, torch.Tensor] | None = None

    def _fbgemm(self) -> tuple[object, torch.Tensor]:
        key = (self.weight.data_ptr(), self.weight._version)
        if self._packed is None or self._packed[0] != key:
            pin = torch.zeros(1, self.in_features, dtype=torch.int8)
            pin[0, 0] = 127
            self._packed = (key, fbgemm_pack(self.weight), pin)
        return self._packed[1], self._packed[2]

    def _code_product(self, xq: torch.Tensor) -> torch.Tensor:
        use = self.backend
        if use == "auto":
            use = "fbgemm" if xq.device.type == "cpu" and fbgemm_int8_available() else "int_mm"
        if use == "fbgemm":
            return fbgemm_int8_product(xq, *self._fbgemm())
        return int8_matmul(xq, self.weight).to(torch.float32)


class Fp8Linear(QuantLinear):
    """W8A8 FP8 (E4M3) linear: torch._scaled_mm on CUDA sm89+, exact fp32 emulation elsewhere.

    `backend` ("auto" | "scaled_mm" | "emulate") picks the GEMM. "auto" uses _scaled_mm only on CUDA
    devices that have it: torch's CPU _scaled_mm works but is slower than the emulation on these
    machines. The emulation keeps the fp32 widening of the codes cached (keyed on the weight
    buffer's version counter, so any in-place write of new codes invalidates it)."""

    fmt = "fp8"
    backend: str = "auto"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._wide: tuple[int, torch.Tensor] | None = None

    def _widened(self) -> torch.Tensor:
        ver = self.weight._version
        if self._wide is None or self._wide[0] != ver:
            self._wide = (ver, self.weight.to(torch.float32))
        return self._wide[1]

    def _code_product(self, xq: torch.Tensor) -> torch.Tensor:
        use = self.backend
        if use == "auto":
            cuda_ok = xq.device.type == "cuda" and scaled_mm_available(xq.device)
            use = "scaled_mm" if cuda_ok else "emulate"
        if use == "scaled_mm":
            # Unit tensor-wise scales (the most widely supported _scaled_mm mode); the real row-wise
            # scales are applied in fp32 by `forward`, exactly as for the emulation.
            one = torch.ones((), device=xq.device)
            return torch._scaled_mm(xq, self.weight.t(), scale_a=one, scale_b=one,
                                    out_dtype=torch.float32)
        return xq.to(torch.float32) @ self._widened().t()


class Int4Linear(QuantLinear):
    """W4A16 linear (the study's stress format, qurl.quant.int4): int4 codes [out, in] held in int8
    with fp32 group scales [out, in // 128]; activations stay in full precision. The forward
    dequantizes the weight once per new set of codes (cached on the buffer's version counter, as
    Fp8Linear's widening) and runs a float matmul in the input's dtype."""

    fmt = "w4a16"

    def __init__(self, in_features: int, out_features: int, bias: bool, bias_dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        nn.Module.__init__(self)
        self.group = int4_group(in_features)  # 128, or gcd(in, 128) where 128 does not tile
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                   device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, in_features // self.group,
                                                        dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.bias = None
        self._deq: tuple[int, int, torch.dtype, torch.Tensor] | None = None

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int4_groups(w, self.group)

    def check_codes(self, codes: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> None:
        check_int4_codes(codes, scale, (self.out_features, self.in_features), self.group, name=name)

    def _weight(self, dtype: torch.dtype) -> torch.Tensor:
        key = (self.weight._version, self.weight_scale._version, dtype)
        if self._deq is None or self._deq[:3] != key:
            self._deq = (*key, dequantize_int4_groups(self.weight, self.weight_scale, dtype))
        return self._deq[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out] in x.dtype."""
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return nn.functional.linear(x, self._weight(x.dtype), bias)


class Siblings:
    """Linears that read the same input (a layer's q/k/v, or gate/up), run as one W8A8 GEMM.

    Per-token activation scales depend only on the input and the weight scales are per output
    channel, so concatenating the members' codes along the output dim and quantizing the input
    once gives every member exactly its own output (int8: bit-equal, the int32 sum is exact; fp8
    emulation: up to fp32 summation order), with one activation quantization and one GEMM where
    there were 3 (or 2). The first member called with a new input computes all outputs; the others
    take theirs (views of one [.., sum out] tensor) until every member has had its output.

    The members keep their own buffers as named tensors (load_weights writes them), re-pointed at
    views of the fused codes/scales so no weight is held twice. A write into a member (copy_: the
    shared version counter moves) or a buffer swap (`.data =`: the storage moves) is seen at the
    next call, which re-concatenates (one copy per weight load) and re-points."""

    def __init__(self, mods: list[QuantLinear]) -> None:
        k = {m.in_features for m in mods}
        if len(k) != 1 or len({type(m) for m in mods}) != 1 or isinstance(mods[0], Int4Linear):
            raise ValueError("siblings must be W8A8 linears of one format with one in_features")
        self.mods, self.sizes = mods, [m.out_features for m in mods]
        first = mods[0]
        bias = first.bias is not None
        self.fused = type(first)(k.pop(), sum(self.sizes), bias,
                                 first.bias.dtype if bias else torch.float32, device=first.weight.device)
        self._key: tuple | None = None
        self._pending: tuple[torch.Tensor, int, list[torch.Tensor], set[int]] | None = None
        for i, m in enumerate(mods):
            m.__dict__["_siblings"] = (self, i)  # a plain attribute: not a submodule, not in state_dict

    def _state(self) -> tuple:
        return tuple((t.data_ptr(), t._version) for m in self.mods
                     for t in (m.weight, m.weight_scale, m.bias) if t is not None)

    def _refresh(self) -> None:
        if self._key == self._state():
            return
        f = self.fused
        with torch.no_grad():
            for name in ("weight", "weight_scale", "bias"):
                if getattr(f, name) is None:
                    continue
                parts = [getattr(m, name) for m in self.mods]
                setattr(f, name, torch.cat(parts))
                off = 0
                for m, n in zip(self.mods, self.sizes):
                    getattr(m, name).data = getattr(f, name)[off : off + n]
                    off += n
        f._packed = None  # new codes: drop the int8 packing / the fp8 widening of the old ones
        f._wide = None
        self._key = self._state()

    def output(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Member i's output for input x: [..., in] -> [..., out_i] in x.dtype."""
        p = self._pending
        if p is None or p[0] is not x or p[1] != x._version or i in p[3]:
            self._refresh()
            outs = list(self.fused._own_forward(x).split(self.sizes, dim=-1))
            p = self._pending = (x, x._version, outs, set())
        p[3].add(i)
        out = p[2][i]
        if len(p[3]) == len(self.mods):
            self._pending = None  # everyone has theirs: hold no activations between calls
        return out


def fuse_siblings(mods: list[QuantLinear]) -> Siblings | None:
    """Group W8A8 linears reading one input (see Siblings); None for int4 (weight-only) layers."""
    return None if isinstance(mods[0], Int4Linear) else Siblings(mods)


QUANT_LINEARS: dict[str, type[QuantLinear]] = {"int8": Int8Linear, "fp8": Fp8Linear,
                                               "w4a16": Int4Linear}


def from_linear(linear: nn.Linear, fmt: str) -> QuantLinear:
    """nn.Linear -> Int8Linear (fmt "int8"), Fp8Linear (fmt "fp8"), weights quantized per channel,
    or Int4Linear (fmt "w4a16", weight-only, per group of 128 columns)."""
    if fmt not in QUANT_LINEARS:
        raise ValueError(f"fmt must be one of {tuple(QUANT_LINEARS)}, got {fmt!r}")
    return QUANT_LINEARS[fmt].from_linear(linear)
