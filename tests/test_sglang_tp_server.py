"""qurl's in-server sync code (qurl/engines/sglang/inside/apply.py) on the two ranks of a TP-2 server,
simulated without SGLang: each rank is a small module holding its cut of a Qwen2-like layer the
way SGLang 0.5.23 holds it (fused qkv / gate_up parts, row-parallel o / down cut by columns,
per-channel scales, the one key/value head replicated on both ranks, a padded vocabulary), loaded
by a reference loader written out by hand for this config (independent of the sharding map).

Checked: a full sync then a delta land on each rank exactly as a fresh load of the new version
(in place: every data_ptr kept); each rank verifies against the digest the learner computed for
it; one code corrupted on one rank fails that rank's verification naming the tensor, and the
ranks' outcomes merge so that every rank fails and none keeps a verified base.
"""
from __future__ import annotations

import pytest
import torch

import qurl.engines.sglang.inside.apply as srv
from qurl.engines.sglang.inside.layout import MISMATCH_MARK, STALE_MARK
from qurl.engines.sglang.inside.tp_cut import Layout
from qurl.engines.sglang.verified_sync import chunk_meta, header_chunk, tp_digests, verify_chunk
from qurl.weights.delta import encode_named
from qurl.weights.digest import combine, named_digests

MQA = Layout(heads=4, kv_heads=1)  # 4 query heads of 2, one kv head: replicated at TP 2
A, M = "model.layers.0.self_attn.", "model.layers.0.mlp."


def hf_version(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)

    def codes(*s):
        return torch.randint(-128, 128, s, generator=g, dtype=torch.int8)

    def scale(n):
        return torch.rand(n, 1, generator=g) + 0.5

    out = []
    for proj, rows, cols in (("q", 8, 8), ("k", 2, 8), ("v", 2, 8), ("o", 8, 8)):
        out += [(f"{A}{proj}_proj.weight", codes(rows, cols)),
                (f"{A}{proj}_proj.weight_scale", scale(rows))]
    for proj, rows, cols in (("gate", 6, 8), ("up", 6, 8), ("down", 8, 6)):
        out += [(f"{M}{proj}_proj.weight", codes(rows, cols)),
                (f"{M}{proj}_proj.weight_scale", scale(rows))]
    return out + [("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
                  ("model.embed_tokens.weight",
                   torch.randn(100, 8, generator=g).to(torch.bfloat16))]


def moved(v: list, seed: int) -> list:
    """Every tensor with ~10% of its values changed (what a training step sends)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, t in v:
        flip = torch.rand(t.shape, generator=g) < 0.1
        out.append((n, torch.where(flip, (t.float() * -0.5 + 1).to(t.dtype), t)))
    return out


class Indices:  # SGLang's VocabParallelEmbeddingShardIndices, the two fields qurl reads
    def __init__(self, start: int, end: int) -> None:
        self.org_vocab_start_index, self.org_vocab_end_index = start, end


def rank_model(rank: int) -> torch.nn.Module:
    """Rank `rank` of 2: the parameters SGLang holds there (zeros until loaded)."""
    def layer(parts=None, **params):
        m = torch.nn.Module()
        for n, (shape, dtype) in params.items():
            m.register_parameter(n, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), False))
        if parts:
            m.output_partition_sizes = parts
        return m

    i8, f32, bf = torch.int8, torch.float32, torch.bfloat16
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    emb = layer(weight=((64, 8), bf))  # 128 padded rows / 2 ranks
    emb.shard_indices = Indices(*((0, 64) if rank == 0 else (64, 100)))
    model.model.embed_tokens, model.model.norm = emb, layer(weight=((8,), bf))
    blk = torch.nn.Module()
    blk.self_attn, blk.mlp = torch.nn.Module(), torch.nn.Module()
    blk.self_attn.qkv_proj = layer([4, 2, 2], weight=((8, 8), i8), weight_scale=((8, 1), f32))
    blk.self_attn.o_proj = layer(weight=((8, 4), i8), weight_scale=((8, 1), f32))
    blk.mlp.gate_up_proj = layer([3, 3], weight=((6, 8), i8), weight_scale=((6, 1), f32))
    blk.mlp.down_proj = layer(weight=((8, 3), i8), weight_scale=((8, 1), f32))
    model.model.layers = torch.nn.ModuleList([blk])
    model.config = type("Cfg", (), {"tie_word_embeddings": True})()
    return model


def reference_load(model: torch.nn.Module, rank: int, named: list) -> None:
    """SGLang's TP-2 cuts for this config, by hand."""
    p = dict(model.named_parameters())
    for name, t in named:
        for proj, (row0, n, src0) in {"q_proj": (0, 4, 4 * rank), "k_proj": (4, 2, 0),
                                      "v_proj": (6, 2, 0), "gate_proj": (0, 3, 3 * rank),
                                      "up_proj": (3, 3, 3 * rank)}.items():
            if f".{proj}." in name:
                fused = name.replace(proj, "qkv_proj" if proj[0] in "qkv" else "gate_up_proj")
                p[fused].data[row0:row0 + n] = t[src0:src0 + n]
                break
        else:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w = p[name].shape[1]
                p[name].data.copy_(t[:, w * rank:w * (rank + 1)])
            elif name == "model.embed_tokens.weight":
                rows = t[64 * rank:64 * (rank + 1)]
                p[name].data.zero_()
                p[name].data[:rows.shape[0]] = rows
            else:  # row-parallel scales [out, 1], norms: whole on every rank
                p[name].data.copy_(t)


def state(rank: int, gather=None) -> srv._State:
    return srv._State(rank=rank, tp=2, layout=MQA, gather=gather)


def load(model, rank, chunks) -> None:
    srv.load_bucket(model, lambda whole: reference_load(model, rank, whole), chunks)


def test_tp2_full_then_delta_in_place_verified_per_rank_and_corruption_caught(monkeypatch):
    v1 = hf_version(0)
    v2 = moved(v1, 1)
    meta = chunk_meta(v1)
    d1, d2 = named_digests(v1), named_digests(v2)
    wire, st = encode_named(dict(v1), v2)
    assert st.delta > 0  # some tensors travel as deltas
    for rank in range(2):
        monkeypatch.setattr(srv, "STATE", state(rank))
        model = rank_model(rank)
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        load(model, rank, [header_chunk(1, None, meta), *v1])
        load(model, rank, [verify_chunk(1, d1, meta, {2: tp_digests(dict(v1), sorted(d1), 2,
                                                                       MQA)})])
        assert srv.STATE.verified == (1, combine(d1))
        load(model, rank, [header_chunk(2, (1, combine(d1)), meta), *wire])
        load(model, rank, [verify_chunk(2, d2, meta, {2: tp_digests(dict(v2), sorted(d2), 2,
                                                                       MQA)})])
        assert srv.STATE.verified == (2, combine(d2))
        fresh = rank_model(rank)
        reference_load(fresh, rank, v2)
        for n, p in fresh.named_parameters():
            held = dict(model.named_parameters())[n]
            assert torch.equal(held.data, p.data), (rank, n)
            assert held.data_ptr() == ptrs[n], (rank, n)
        # a digest meant for the other rank does not verify this one
        swapped = {n: ds[::-1] for n, ds in tp_digests(dict(v2), sorted(d2), 2, MQA).items()}
        with pytest.raises(srv.Mismatch) as e:
            load(model, rank, [header_chunk(3, (2, combine(d2)), meta),
                               verify_chunk(3, d2, meta, {2: swapped})])
        assert e.value.names and all("k_proj" not in n and "v_proj" not in n and "norm" not in n
                                     for n in e.value.names)  # replicated tensors still match
        if rank == 1:  # one code flipped behind qurl's back, in the replicated k head
            srv.STATE.verified = (2, combine(d2))
            p = dict(model.named_parameters())[A + "qkv_proj.weight"]
            p.data[5, 0] ^= 1
            with pytest.raises(ValueError, match=MISMATCH_MARK) as e:
                load(model, rank, [header_chunk(3, (2, combine(d2)), meta),
                                   verify_chunk(3, d2, meta, {2: tp_digests(
                                       dict(v2), sorted(d2), 2, MQA)})])
            assert e.value.names == [A + "k_proj.weight"]
            assert srv.STATE.verified is None


def test_an_invalid_delta_is_refused_before_any_delta_is_written(monkeypatch):
    v1 = hf_version(0)
    meta = chunk_meta(v1)
    monkeypatch.setattr(srv, "STATE", state(0))
    model = rank_model(0)
    load(model, 0, [header_chunk(1, None, meta), *v1])
    load(model, 0, [verify_chunk(1, named_digests(v1), meta,
                                 {2: tp_digests(dict(v1), sorted(meta), 2, MQA)})])
    base = (1, combine(named_digests(v1)))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wire, _ = encode_named(dict(v1), moved(v1, 2))
    target = A + "o_proj.weight#dend"
    assert any(n == target for n, _ in wire)
    # the deltas only (whole tensors go to SGLang's own loader first), one with block ends past
    # its positions: invalid
    bad = [(n, t + 5 if n == target else t) for n, t in wire if "#d" in n]
    assert len(bad) > 3
    with pytest.raises(ValueError, match="block ends"):
        load(model, 0, [header_chunk(2, base, meta), *bad])
    for n, p in model.named_parameters():
        assert torch.equal(p.data, before[n]), n
    # verification without this TP size's digests: nothing is vouched for
    load(model, 0, [header_chunk(3, None, meta), *v1])
    with pytest.raises(srv.Mismatch):
        load(model, 0, [verify_chunk(3, named_digests(v1), meta)])
    assert srv.STATE.verified is None


def test_outcomes_merge_over_ranks(monkeypatch):
    """Only rank 0 answers SGLang's HTTP call: a mismatch on rank 1 must fail rank 0 too."""
    v1 = hf_version(0)
    meta = chunk_meta(v1)
    d = named_digests(v1)
    sent, rank1 = [], [None, ("mismatch", [A + "o_proj.weight"])]

    def gather(outcome):  # rank 1: the full sync's bucket loads, its verification mismatches
        sent.append(outcome)
        return [outcome, rank1[len(sent) - 1]]

    monkeypatch.setattr(srv, "STATE", state(0, gather))
    model = rank_model(0)
    load(model, 0, [header_chunk(1, None, meta), *v1])
    with pytest.raises(ValueError, match=MISMATCH_MARK) as e:
        load(model, 0, [verify_chunk(1, d, meta, {2: tp_digests(dict(v1), sorted(d), 2, MQA)})])
    assert sent == [None, None]  # rank 0 itself matched
    assert '["model.layers.0.self_attn.o_proj.weight"]' in str(e.value)
    assert srv.STATE.verified is None  # rank 0 keeps no verified base either
    # a stale refusal on any rank refuses the sync on all, and its later buckets
    monkeypatch.setattr(srv, "STATE", state(0, lambda o: [o, ("stale", "rank 1 stale")]))
    with pytest.raises(ValueError, match=STALE_MARK):
        load(model, 0, [header_chunk(2, None, meta)])
    assert srv.STATE.refused and not srv.STATE.open
    # any other error: a plain failure naming the rank
    monkeypatch.setattr(srv, "STATE", state(0, lambda o: [o, ("error", "KeyError: x")]))
    with pytest.raises(RuntimeError, match="rank 1: KeyError"):
        load(model, 0, [header_chunk(4, None, meta)])
