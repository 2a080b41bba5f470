"""`qurl bench sync --moe`'s byte accounting (qurl/research/bench/sync_moe.py) on a tiny MoE.

The bench observes the product's `WeightSync` and splits every sync's bytes into expert codes,
expert scales, router, dense codes, dense scales and other. Here two real syncs into a local INT8
engine (v0 in full; v1 after one Adam step of the HF model, so only routed experts move) are
observed and the split is checked against what it must equal:
- the whole version's expert bytes: the closed form of the fused layout, L x E x (2I x H + H x I)
  int8 codes and L x E x (2I + H) fp32 scales;
- the bytes sent, per category: the sizes of the chunks the delta encoder produces for the same
  two versions, grouped by a name test of its own (`.mlp.experts.w13/w2_weight` owners), and in
  total the sync's own `sync/bytes` record.
"""
from __future__ import annotations

import torch

from qurl.engines.local import LocalEngine
from qurl.models import moe
from qurl.models.hf import build_model, load_checkpoint
from qurl.quant.named import engine_chunks
from qurl.research.bench.sync_moe import CATEGORIES, SyncObserver
from qurl.weights.delta import delta_owner, encode_named
from qurl.weights.publish import WeightSync

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
L, E, I, H = 2, 8, 32, 64


def _named(model) -> list[tuple[str, torch.Tensor]]:
    sd = moe.per_expert({k: v.detach().clone() for k, v in model.state_dict().items()})
    sd.pop("lm_head.weight", None)  # tied
    return list(sd.items())


def test_expert_bytes_equal_the_expert_chunks_sent(tmp_path, one_thread):
    model_dir = build_model(tmp_path / "m", "tiny-qwen3-moe", overrides=TINY)
    model = load_checkpoint(model_dir, dtype=torch.float32)[0]
    v0 = _named(model)
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=3e-5)  # the recipe's lr
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    v1 = _named(model)

    obs = SyncObserver("int8")
    orig = WeightSync.push
    obs.install()
    try:
        eng, sync = LocalEngine(model_dir, precision="int8"), WeightSync("int8", mode="delta")
        stats = [sync.push(iter(v), eng, k) for k, v in ((0, v0), (1, v1))]
    finally:
        obs.remove()
    assert WeightSync.push is orig  # the product's class is restored
    assert [r["mode"] for r in obs.rows] == ["full", "delta"]
    assert all(s["sync/verified"] == 1.0 for s in stats)

    codes, scales = L * E * (2 * I * H + H * I), L * E * (2 * I + H) * 4
    for r, s in zip(obs.rows, stats):
        assert (r["full"]["expert codes"], r["full"]["expert scales"]) == (codes, scales)
        assert sum(r["sent"].values()) == s["sync/bytes"]
    assert obs.rows[0]["sent"] == obs.rows[0]["full"]

    # what the delta encoder sends for the same two versions, grouped by its own name test
    prev = {n: t.clone() for n, t in engine_chunks(v0, "int8")}
    wire, st = encode_named(prev, list(engine_chunks(v1, "int8")))
    assert st.bytes == stats[1]["sync/bytes"]
    want = dict.fromkeys(("expert codes", "expert scales", "rest"), 0)
    for name, t in wire:
        owner = delta_owner(name)
        kind = ("expert scales" if owner.endswith("_scale") else "expert codes") \
            if ".mlp.experts.w13_weight" in owner or ".mlp.experts.w2_weight" in owner else "rest"
        want[kind] += t.numel() * t.element_size()
    sent = obs.rows[1]["sent"]
    assert (sent["expert codes"], sent["expert scales"]) == (want["expert codes"],
                                                             want["expert scales"])
    assert sum(sent[c] for c in CATEGORIES[2:]) == want["rest"]
    assert 0 < sent["expert codes"] < codes  # a delta: some expert codes flipped, not all
    assert 0 < obs.rows[1]["changed"]["expert codes"] < 1
