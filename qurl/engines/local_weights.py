"""The local engine's weights: staged, checked, committed, and verified against the sender's digests.

`load_weights` stages then commits: every chunk is checked (known name, shape, dtype kind, finite
values; 8-bit codes arrive with their `_scale`) and full-precision linears are quantized before
anything is written, so a bad chunk raises ValueError naming the tensor and leaves the old weights
and version in place. Staging holds one copy of the incoming tensors.

Deltas and verification (qurl/weights/delta.py, qurl/weights/digest.py). `load_weights(..., base=(v-1,
digest))` also accepts delta chunks (`<name>#dpos/#dend/#dval`): it refuses (`StaleBase`, before
reading a chunk) unless the engine holds exactly v-1 with that verified digest, validates every
delta against the tensor it changes, and writes the changed positions in place at commit (a
tensor not named keeps its bits). `verify(digests)` hashes what the engine holds, under the
sender's names and in the dtype each tensor was last sent in, and returns the names that differ;
only a verified version can be the base of the next delta (`digest`; any load clears it).

`LocalWeights` is that part of `LocalEngine` (qurl/engines/local.py); it works on the engine's
live tensors by name (`_tensors`: parameters and buffers of the model, codes and `_scale`s of its
8-bit linears), its 8-bit linears (`_qlinears`), `precision`, `device` and version.
"""
from __future__ import annotations

from typing import Iterable

import torch

from qurl.types import StaleBase
from qurl.quant.formats import all_finite, fp8_has_nan
from qurl.weights.delta import apply_positions, check_delta, group_delta_chunks
from qurl.weights.digest import combine, digest_target, mismatches, tensor_digest

CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)
SCALE = "_scale"


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads and signed zeros included), for same-dtype tensors."""
    as_int = _INT_OF_SIZE[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


class LocalWeights:
    """LocalEngine's weight loading and verification (see the module docstring)."""

    @property
    def digest(self) -> str | None:
        """Combined digest (qurl/weights/digest.py) of the weights, if `verify` vouched for them
        since the last load; None otherwise."""
        return self._digest

    can_verify = True  # the local engine always hashes what it holds

    def load_weights(self, chunks: Iterable[tuple[str, torch.Tensor]], version: int, *,
                     adopt: bool = False, base: tuple[int, str] | None = None) -> None:
        """Stage, validate and then commit named tensors; set `version` after the last one.

        adopt=True: the caller promises the chunks' memory stays untouched until the next load
        (the weight receiver's double-banked buffers). When the chunks then cover every tensor of
        the model with its dtype, the engine takes them as its own (`.data` swapped at commit)
        instead of copying them; otherwise it copies, as without `adopt`. All or nothing, so the
        engine never holds some tensors in the caller's memory and some in its own; `adopted`
        says which happened (the receiver reuses its other bank only after an adoption). W8A8
        engines run each layer's q/k/v and gate/up as one GEMM (qlinear.Siblings): their first
        forward after a load concatenates those codes into the engine's own buffer (one copy of the
        linear codes per load) and lets go of the adopted chunks for them.

        base=(v-1, digest): a delta sync (module docstring); StaleBase unless this engine holds
        exactly that verified version. Without base, delta chunks are unknown names (refused)."""
        if base is not None and (self._version, self._digest) != (int(base[0]), base[1]):
            raise StaleBase(f"delta for base v{base[0]} ({base[1]}): this engine holds "
                            f"v{self._version} ({self._digest or 'unverified'})")
        staged: dict[str, torch.Tensor] = {}
        for name, t in chunks:
            if base is None or "#d" not in name:
                staged[name] = self._check_chunk(name, t, copy=not adopt)
            else:
                staged[name] = t.detach().to(self.device, copy=not adopt)
        staged, deltas = group_delta_chunks(staged.items())
        checked = {n: self._check_delta(n, parts) for n, parts in deltas.items()}
        writes = self._resolve(staged, partial=base is not None)
        n_live = len({id(t) for t in self._tensors.values()})  # tied weights: two names, one tensor
        take = adopt and not checked and len({id(self._tensors[n]) for n in writes}) == n_live \
            and all(t.dtype == self._tensors[n].dtype and t.device == self._tensors[n].device
                    and t.is_contiguous() for n, t in writes.items())
        with torch.no_grad():
            for name, t in writes.items():
                if take:
                    self._tensors[name].data = t
                else:
                    self._tensors[name].copy_(t)
            for name, (pos, val) in checked.items():
                apply_positions(self._tensors[name], pos, val)
        self._wire_dtype.update({n: t.dtype for n, t in staged.items()})
        self.adopted = take
        self._version = int(version)
        self._digest = None

    def verify(self, digests: dict[str, str]) -> list[str]:
        """Hash the tensors named in `digests` (the sender's, of the version just loaded) as the
        engine holds them, cast to the dtype they were sent in; [] and `digest` set when all
        match, else the names that differ (`digest` stays None: no delta builds on them); a MoE
        layer's fused experts are hashed one expert at a time (`name@expert<e>`, as the sender's
        qurl/weights/digest.py `named_digests`), so a difference names its layer and expert.
        A tensor held wider than it was sent (fp32 from bf16) must also hold nothing the wire
        could not carry — every held bit is checked, not only those the cast keeps."""
        got = {}
        for key in digests:
            name, expert = digest_target(key)  # a MoE expert's slice of a fused tensor, or all
            t = self._tensors.get(name)
            if t is not None and expert is not None:
                t = t[expert] if expert < t.shape[0] else None
            if t is not None:
                want = self._wire_dtype.get(name, t.dtype)
                sent = t if t.dtype == want else t.to(want)
                exact = sent is t or _same_bits(sent.to(t.dtype), t)
                got[key] = tensor_digest(sent) if exact else "beyond-wire-precision"
        bad = mismatches(digests, got)
        self._digest = None if bad else combine(digests)
        return bad

    def _check_delta(self, name: str, parts: dict[str, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate one delta against the live tensor it changes (writes nothing)."""
        if name not in self._tensors:
            raise ValueError(f"{name}: delta for no tensor of the engine's model")
        target = self._tensors[name]
        want = self._wire_dtype.get(name, target.dtype)
        if want != target.dtype:
            raise ValueError(f"{name}: a delta needs the tensor sent in the engine's dtype "
                             f"({target.dtype}), it was sent as {want}")
        pos, val = check_delta(name, target, parts)
        if val.dtype in CODE_DTYPES:
            qmod = self._qlinears.get(name)
            if qmod is None:
                raise ValueError(f"{name}: got 8-bit codes ({val.dtype}) for a full-precision tensor")
            if val.dtype == torch.float8_e4m3fn and fp8_has_nan(val):
                raise ValueError(f"{name}: fp8 codes contain NaN")
        elif not all_finite(val):
            raise ValueError(f"{name}: contains NaN or inf")
        elif name.endswith(SCALE) and name[: -len(SCALE)] in self._qlinears and \
                not bool((val > 0).all()):
            raise ValueError(f"{name}: scales must be finite and > 0")
        return pos, val

    def _check_chunk(self, name: str, t: torch.Tensor, copy: bool = True) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if name not in self._tensors:
            bf16_scale = self.precision == "bf16" and name.endswith(SCALE)
            hint = " (this engine is bf16: send full-precision weights)" if bf16_scale else ""
            raise ValueError(f"{name}: no tensor of that name in the engine's model{hint}")
        target = self._tensors[name]
        if tuple(t.shape) != tuple(target.shape):
            raise ValueError(
                f"{name}: shape {tuple(t.shape)} does not match the model's {tuple(target.shape)}")
        quant_weight = name in self._qlinears
        if t.dtype in CODE_DTYPES:
            if not quant_weight:
                raise ValueError(f"{name}: got 8-bit codes ({t.dtype}) for a full-precision tensor")
            if t.dtype != target.dtype:
                raise ValueError(
                    f"{name}: got {t.dtype} codes, this {self.precision} engine holds {target.dtype}")
        elif not torch.is_floating_point(t):
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
        elif not all_finite(t):
            raise ValueError(f"{name}: contains NaN or inf")
        return t.detach().to(self.device, copy=copy)  # copy: the sender may reuse its buffers

    def _resolve(self, staged: dict[str, torch.Tensor], partial: bool = False
                 ) -> dict[str, torch.Tensor]:
        """Pair codes with scales and quantize full-precision linears; returns the tensors to write.
        partial (a delta sync): codes or a scale may come alone (the other unchanged or sent as a
        delta, checked on its own); the engine's current partner is then checked with it."""
        writes = dict(staged)
        for name, qmod in self._qlinears.items():
            w, s = staged.get(name), staged.get(name + SCALE)
            if partial and (w is None) != (s is None) and (w is None or w.dtype in CODE_DTYPES):
                qmod.check_codes(self._tensors[name] if w is None else w,
                                 self._tensors[name + SCALE] if s is None else s, name)
                continue
            if w is None:
                if s is not None:
                    raise ValueError(f"{name + SCALE}: scale sent without its codes {name}")
                continue
            if w.dtype in CODE_DTYPES:
                if s is None:
                    raise ValueError(f"{name}: 8-bit codes sent without {name + SCALE}")
                qmod.check_codes(w, s, name)
            else:
                if s is not None:
                    raise ValueError(f"{name + SCALE}: scale sent with a full-precision {name}")
                codes, scale = qmod.quantize(w)
                writes[name], writes[name + SCALE] = codes, scale
        return writes
