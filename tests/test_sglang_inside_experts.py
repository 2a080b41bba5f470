"""qurl's in-server expert loader (qurl/engines/sglang/inside/experts.py) and per-expert
verification (apply.py `targets_of` on `<name>@expert<e>` keys), simulated without SGLang: a
module holding one MoE layer's experts as SGLang's FusedMoE holds them at TP 1 (`w13_weight`
[E, 2I, H] gate rows then up rows, `w2_weight` [E, H, I], int8 codes with fp32 scales
[E, rows, 1]).

Checked: a full sync of fused expert tensors lands in place (every data_ptr kept) and verifies per
expert; a delta that moves one expert applies and verifies; one code flipped in one expert fails
verification naming exactly that expert's slice; a tensor the server holds in another layout (a
TP > 1 cut) is refused before anything is written. The real server: tests/test_sglang_real_moe.py.
"""
from __future__ import annotations

import pytest
import torch

import qurl.engines.sglang.inside.apply as srv
from qurl.engines.sglang.verified_sync import chunk_meta, header_chunk, key_meta, verify_chunk
from qurl.quant.experts import fuse_experts
from qurl.quant.named import engine_chunks
from qurl.weights.delta import encode_named
from qurl.weights.digest import combine, named_digests

E, I, H = 4, 8, 16
P = "model.layers.0.mlp.experts."


class Experts(torch.nn.Module):
    def __init__(self, rows13: int = 2 * I) -> None:
        super().__init__()
        z = dict(requires_grad=False)
        self.w13_weight = torch.nn.Parameter(torch.zeros(E, rows13, H, dtype=torch.int8), **z)
        self.w2_weight = torch.nn.Parameter(torch.zeros(E, H, I, dtype=torch.int8), **z)
        self.w13_weight_scale = torch.nn.Parameter(torch.ones(E, rows13, 1), **z)
        self.w2_weight_scale = torch.nn.Parameter(torch.ones(E, H, 1), **z)


def server_model(rows13: int = 2 * I) -> torch.nn.Module:
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = Experts(rows13)
    root.model.layers = torch.nn.ModuleList([layer])
    return root


def version(seed: int, moved: int | None = None, base=None) -> list[tuple[str, torch.Tensor]]:
    """int8 engine chunks of one layer's experts (fused per layer, as qurl's sync sends them);
    with `moved`, `base`'s per-expert weights with only that expert redrawn."""
    g = torch.Generator().manual_seed(seed)
    per = dict(base) if base is not None else {}
    for e in range(E):
        if base is None or e == moved:
            per[f"{P}{e}.gate_proj.weight"] = torch.randn(I, H, generator=g)
            per[f"{P}{e}.up_proj.weight"] = torch.randn(I, H, generator=g)
            per[f"{P}{e}.down_proj.weight"] = torch.randn(H, I, generator=g)
    return per, list(engine_chunks(sorted(per.items()), "int8"))


def load(model, chunks) -> None:
    def inner(whole):  # SGLang's own load_weights: must never see a fused expert name
        assert not whole, [n for n, _ in whole]

    srv.load_bucket(model, inner, chunks)


def test_fused_experts_load_in_place_and_verify_per_expert(monkeypatch):
    monkeypatch.setattr(srv, "STATE", srv._State())
    per1, v1 = version(0)
    assert [n for n, _ in v1] == [P + "w13_weight", P + "w13_weight_scale", P + "w2_weight",
                                  P + "w2_weight_scale"]
    meta, d1 = chunk_meta(v1), named_digests(v1)
    assert P + "w13_weight@expert3" in d1 and key_meta(meta, P + "w13_weight@expert3") == \
        ([2 * I, H], "int8")
    model = server_model()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    load(model, [header_chunk(1, None, meta), *v1])
    load(model, [verify_chunk(1, d1, meta)])
    assert srv.STATE.verified == (1, combine(d1))
    held = dict(model.named_parameters())
    for n, t in v1:
        assert torch.equal(held[n].data, t) and held[n].data_ptr() == ptrs[n], n

    # a delta that redraws expert 2 only: applied in place, verified
    _, v2 = version(1, moved=2, base=per1)
    wire, st = encode_named(dict(v1), v2)
    assert st.delta > 0
    d2 = named_digests(v2)
    assert {k for k in d2 if d2[k] != d1[k]} <= {f"{P}{w}@expert2" for w in
                                                  ("w13_weight", "w13_weight_scale", "w2_weight",
                                                   "w2_weight_scale")}
    load(model, [header_chunk(2, (1, combine(d1)), meta), *wire])
    load(model, [verify_chunk(2, d2, meta)])
    assert srv.STATE.verified == (2, combine(d2))
    for n, t in v2:
        assert torch.equal(held[n].data, t) and held[n].data_ptr() == ptrs[n], n

    # one code of expert 1 flipped behind qurl's back: exactly that expert's slice is named
    held[P + "w13_weight"].data[1, I + 3, 5] ^= 1  # an up row of expert 1
    with pytest.raises(srv.Mismatch) as e:
        load(model, [header_chunk(3, (2, combine(d2)), meta), verify_chunk(3, d2, meta)])
    assert e.value.names == [P + "w13_weight@expert1"]


def test_a_layout_qurl_does_not_know_is_refused_before_writing(monkeypatch):
    monkeypatch.setattr(srv, "STATE", srv._State())
    _, v1 = version(0)
    model = server_model(rows13=I)  # a TP 2 rank's cut: [E, 2I/2, H]
    with pytest.raises(ValueError, match=r"holds \(4, 8, 16\) torch.int8, qurl sent \(4, 16, 16\)"):
        load(model, [header_chunk(1, None, chunk_meta(v1)), *v1])
    assert not dict(model.named_parameters())[P + "w13_weight"].data.any()


def test_fuse_experts_order_is_what_the_server_holds():
    """The fused tensor the sync sends is each expert's gate rows, then its up rows."""
    g = torch.Generator().manual_seed(0)
    per = {f"{P}{e}.{w}_proj.weight": torch.randn(*(I, H) if w != "down" else (H, I), generator=g)
           for e in range(E) for w in ("gate", "up", "down")}
    fused = dict(fuse_experts(sorted(per.items())))
    for e in range(E):
        assert torch.equal(fused[P + "w13_weight"][e], torch.cat([per[f"{P}{e}.gate_proj.weight"],
                                                                 per[f"{P}{e}.up_proj.weight"]]))
        assert torch.equal(fused[P + "w2_weight"][e], per[f"{P}{e}.down_proj.weight"])
