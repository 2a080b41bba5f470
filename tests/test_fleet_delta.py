"""The fleet's delta decision for async rollout workers (qurl/pipeline/fleet.py), without processes.

Each worker's hello says whether its engine can apply deltas (`deltas`: it has `verify`). The fleet
plans a version as a delta against the one every group member holds only when every slot said it
can; one slot that cannot (an SGLang engine without qurl's sync loader or with TP > 1, or a worker
that does not say) makes every version full, counted as `unsupported`. The weight group is a stand-in
that records what would be broadcast, and control messages are captured instead of sent.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qurl.pipeline.fleet import Fleet
from tests.pipeline_helpers import fleet_of, tiny_cfg


class _Group:
    """Stands in for the Broadcaster: takes the chunks, announces one bucket, sends nothing."""
    gen = 1

    def __init__(self) -> None:
        self.sent: list[list[tuple[str, torch.Tensor]]] = []

    def send(self, chunks, version, announce):
        self.sent.append(list(chunks))
        announce(SimpleNamespace(index=0, to_dict=lambda: {"version": version, "index": 0}))
        return SimpleNamespace(metrics=lambda: {"sync/bytes": float(
            sum(t.numel() * t.element_size() for _, t in self.sent[-1]))})

    def close(self) -> None:
        pass


@pytest.fixture
def fleet(tmp_path):
    cfg = tiny_cfg(tmp_path, "fleet", 1, **{"deploy.engines": 2})
    (tmp_path / "fleet").mkdir()
    f = fleet_of(cfg, tmp_path / "fleet", vocab_size=100, spawn=False)
    f.weights.close()
    f.weights = _Group()
    f.control: list[tuple[int, dict]] = []
    f.send_control = lambda slot, meta, timeout_ms=0: f.control.append((slot, meta)) or True
    yield f
    f.close()


def _hello(fleet: Fleet, slot: int, **extra) -> None:
    fleet._on_control({"op": "hello", "slot": slot, "session": fleet.session, "pid": 1000 + slot,
                       "gen": -1, "endpoint": "tcp://127.0.0.1:9", **extra})


def _versions() -> list[list[tuple[str, torch.Tensor]]]:
    """Three versions of an int8 weight (+ its scale): one code changes from each to the next."""
    w = torch.arange(-64, 64, dtype=torch.int8).reshape(8, 16)
    s = torch.ones(8, 1)
    out = []
    for v in range(3):
        w = w.clone()
        w[v, 3] += 1
        out.append([("layer.weight", w), ("layer.weight_scale", s)])
    return out


def _headers(fleet: Fleet) -> list[dict]:
    return [m["sync"] for _, m in fleet.control if m.get("op") == "weights" and "sync" in m]


def test_all_slots_can_take_deltas(fleet):
    _hello(fleet, 0, deltas=True)
    _hello(fleet, 1, deltas=True)
    assert fleet.can_delta()
    recs = [fleet.broadcast(chunks, v) for v, chunks in enumerate(_versions())]
    assert [r["sync/delta"] for r in recs] == [0.0, 1.0, 1.0]
    assert recs[0]["sync/full_reason/first"] == 1.0
    heads = _headers(fleet)
    assert len(heads) == 6  # every announcement goes to both slots
    assert [h["mode"] for h in heads[::2]] == ["full", "delta", "delta"]
    assert heads[2]["base"] == [0, heads[0]["digest"]] and heads[4]["base"] == [1, heads[2]["digest"]]
    # a delta of one changed code sends that code (and its position), not the 128-code tensor
    assert recs[1]["sync/bytes"] < recs[1]["sync/full_bytes"] == recs[0]["sync/full_bytes"]
    assert "sync/fallbacks/unsupported" not in recs[-1]


@pytest.mark.parametrize("second", [{"deltas": False}, {}], ids=["cannot", "silent"])
def test_one_slot_that_cannot_makes_every_sync_full(fleet, second):
    _hello(fleet, 0, deltas=True)
    _hello(fleet, 1, **second)  # a worker that does not say is taken as one that cannot
    assert not fleet.can_delta()
    recs = [fleet.broadcast(chunks, v) for v, chunks in enumerate(_versions())]
    assert [r["sync/delta"] for r in recs] == [0.0, 0.0, 0.0]
    assert all(r["sync/full_reason/unsupported"] == 1.0 for r in recs)
    assert recs[-1]["sync/fallbacks/unsupported"] == 3.0
    assert [h["mode"] for h in _headers(fleet)] == ["full"] * 6
    assert [r["sync/bytes"] for r in recs] == [r["sync/full_bytes"] for r in recs]


def test_a_replaced_worker_that_cannot_turns_deltas_off(fleet):
    """A slot whose new process cannot take deltas (new pid in its hello) stops them at once."""
    _hello(fleet, 0, deltas=True)
    _hello(fleet, 1, deltas=True)
    vs = _versions()
    assert fleet.broadcast(vs[0], 0)["sync/delta"] == 0.0
    assert fleet.broadcast(vs[1], 1)["sync/delta"] == 1.0
    fleet._on_control({"op": "hello", "slot": 1, "session": fleet.session, "pid": 77, "gen": -1,
                       "endpoint": "tcp://127.0.0.1:9", "deltas": False})
    assert fleet.take_replaced() == [1] and not fleet.can_delta()
    rec = fleet.broadcast(vs[2], 2)
    assert rec["sync/delta"] == 0.0 and rec["sync/full_reason/unsupported"] == 1.0


def test_an_unchanged_version_goes_as_a_delta_of_one_whole_tensor(fleet):
    """A step without gradient publishes the same weights: an empty delta, but a broadcast needs
    a tensor, so the smallest one goes whole (what a full sync would send for it)."""
    _hello(fleet, 0, deltas=True)
    _hello(fleet, 1, deltas=True)
    v0 = _versions()[0]
    fleet.broadcast(v0, 0)
    rec = fleet.broadcast([(n, t.clone()) for n, t in v0], 1)
    assert rec["sync/delta"] == 1.0 and rec["sync/tensors_same"] == 2.0
    (sent,) = fleet.weights.sent[1:]
    assert [n for n, _ in sent] == ["layer.weight_scale"]  # 8 fp32 = 32 bytes < 128 int8 codes
    assert torch.equal(sent[0][1], v0[1][1]) and rec["sync/bytes"] == 32.0
