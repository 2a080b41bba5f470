"""Issue 66: one home for weight sync's resync rule (qurl/weights/resync.py `ResyncRule`).

The rule: a load of a version into a holder ends ok, refused (a delta on a base the holder lacks)
or mismatch (its digests differ from the learner's); ok is accepted, refused or a first mismatch
sends the version again in full, a second mismatch in a row halts the run with one line naming
the holder, the version and the tensors. First the rule alone, on hand-worked sequences; then
both of its users — the synchronous loop's `WeightSync.push` with a real local engine whose
loads are corrupted, and the async `Fleet` fed the control messages its workers send for the
same loads — with the rule's `decide` spied on: both call it with the same outcomes, get the
same decisions, and stop with the same error but for the holder's name.
"""
from __future__ import annotations

import pytest
import torch

from qurl.types import StaleBase
from qurl.engines.local import LocalEngine
from qurl.engines.local_weights import LocalWeights
from qurl.errors import RunHalted
from qurl.models.hf import build_model, read_state_dict
from qurl.weights.publish import WeightSync
from qurl.weights.resync import (ACCEPT, HALT, MISMATCH, OK, OTHER, REFUSED, RESYNC, Decision,
                              ResyncRule, engine_label)

LAYER = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs with one torch thread (conftest.one_thread)."""


# ------------------------------------------------------------------ the rule alone

def _run(rule: ResyncRule, outcomes: list[str], holder: object = "e") -> list[tuple]:
    out = []
    for o in outcomes:
        d = rule.decide(holder, o, version=7, bad=[LAYER], who="E (int8)")
        out.append((d.action, d.reason))
    return out


def test_ok_is_accepted():
    rule = ResyncRule()
    assert _run(rule, [OK]) == [(ACCEPT, None)] and rule.streak("e") == 0


def test_refused_then_full_ok():
    rule = ResyncRule()
    assert _run(rule, [REFUSED, OK]) == [(RESYNC, REFUSED), (ACCEPT, None)]
    assert rule.streak("e") == 0


def test_mismatch_then_full_ok():
    rule = ResyncRule()
    assert _run(rule, [MISMATCH]) == [(RESYNC, MISMATCH)] and rule.streak("e") == 1
    assert _run(rule, [OK]) == [(ACCEPT, None)] and rule.streak("e") == 0


def test_mismatch_then_full_mismatch_halts_in_one_line():
    rule = ResyncRule()
    first = rule.decide("e", MISMATCH, version=7, bad=[LAYER], who="E (int8)")
    second = rule.decide("e", MISMATCH, version=7, bad=[LAYER, "b", "c", "d"], who="E (int8)")
    assert first == Decision(RESYNC, MISMATCH)
    assert (second.action, second.reason) == (HALT, MISMATCH)
    assert isinstance(second.error, RunHalted)
    msg = str(second.error)
    assert "\n" not in msg
    assert msg.startswith("weight sync v7: E (int8) still differs from the learner's weights after "
                          f"a full resync, in 4 tensors: {LAYER}, b, c and 1 more; the run stops")
    assert msg.endswith("`qurl train --resume <run dir>`")


def test_an_ok_resets_the_streak():
    rule = ResyncRule()
    assert _run(rule, [MISMATCH, OK, MISMATCH, OK, MISMATCH]) == [
        (RESYNC, MISMATCH), (ACCEPT, None), (RESYNC, MISMATCH), (ACCEPT, None), (RESYNC, MISMATCH)]


def test_a_refusal_neither_counts_nor_forgives_a_mismatch():
    rule = ResyncRule()
    assert [a for a, _ in _run(rule, [MISMATCH, REFUSED, OTHER, MISMATCH])] == [
        RESYNC, RESYNC, RESYNC, HALT]


def test_streaks_are_per_holder_and_a_forgotten_holder_starts_clean():
    rule = ResyncRule()
    assert _run(rule, [MISMATCH], 0) == _run(rule, [MISMATCH], 1) == [(RESYNC, MISMATCH)]
    rule.forget(0)  # slot 0's worker was replaced
    assert _run(rule, [MISMATCH], 0) == [(RESYNC, MISMATCH)]
    assert _run(rule, [MISMATCH], 1) == [(HALT, MISMATCH)]


def test_malformed_names_and_unknown_outcomes():
    rule = ResyncRule()
    rule.decide(3, MISMATCH)
    halt = rule.decide(3, MISMATCH, version="5", bad=[1, None], who="w")
    assert "weight sync v5: w still differs" in str(halt.error) and "in 1 tensor: ?;" in str(halt.error)
    with pytest.raises(ValueError, match="outcome 'bogus'"):
        rule.decide(3, "bogus")


# ------------------------------------------------------------------ both users, one code path

@pytest.fixture
def decided(monkeypatch) -> list[tuple[object, str, Decision]]:
    """Every call of ResyncRule.decide, by anyone: (holder, outcome, decision)."""
    seen: list[tuple[object, str, Decision]] = []
    real = ResyncRule.decide

    def spy(self, holder, outcome, **kw):
        d = real(self, holder, outcome, **kw)
        seen.append((holder, outcome, d))
        return d

    monkeypatch.setattr(ResyncRule, "decide", spy)
    return seen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "tiny2", "tiny", seed=1,
                       overrides={"num_hidden_layers": 2, "initializer_range": 0.1})


@pytest.fixture
def fleet(tmp_path):
    from pipeline_helpers import fleet_of, tiny_cfg

    cfg = tiny_cfg(tmp_path, "fleet", 1, **{"deploy.engines": 1})
    (tmp_path / "fleet").mkdir()
    f = fleet_of(cfg, tmp_path / "fleet", vocab_size=100, spawn=False)
    yield f
    f.close()


def _versions(model_dir, n: int) -> list[list[tuple[str, torch.Tensor]]]:
    """n fp32 versions; each moves every weight a little on a random quarter of its entries."""
    g = torch.Generator().manual_seed(0)
    named = {k: v.float() for k, v in read_state_dict(model_dir).items()}
    out = []
    for _ in range(n):
        out.append([(k, v.clone()) for k, v in named.items()])
        for v in named.values():
            v += (torch.rand(v.shape, generator=g) < 0.25) * torch.randn(v.shape, generator=g) * 2e-3
    return out


def _corrupt_loads_from(version: int):
    """LocalWeights.load_weights that changes one 8-bit code of LAYER after every load of a
    version >= `version` (a broken loader): the digest check fails, the full resync's too."""
    real = LocalWeights.load_weights

    def load(self, chunks, v, **kw):
        real(self, chunks, v, **kw)
        if v >= version:
            with torch.no_grad():
                code = self._tensors[LAYER].view(-1)
                code[0] = code[0] + 1 if code[0] < 127 else code[0] - 1
    return load


def _refuse_one_delta():
    """LocalWeights.load_weights that refuses the first delta it is given (StaleBase)."""
    real, refused = LocalWeights.load_weights, []

    def load(self, chunks, v, **kw):
        if kw.get("base") is not None and not refused:
            refused.append(v)
            raise StaleBase(f"delta v{v} refused (test)")
        real(self, chunks, v, **kw)
    return load


def _ctl(fleet, slot: int, **meta) -> None:
    fleet._on_control({"slot": slot, "session": fleet.session, **meta})


def _trace(decided) -> list[tuple]:
    return [(o, d.action, d.reason) for _, o, d in decided]


def test_a_refused_delta_takes_the_same_path_in_process_and_in_the_fleet(model_dir, fleet,
                                                                        decided, monkeypatch):
    v0, v1 = _versions(model_dir, 2)
    engine = LocalEngine(model_dir, precision="int8")
    sync = WeightSync("int8")
    sync.push(iter(v0), engine, 0)
    monkeypatch.setattr(LocalWeights, "load_weights", _refuse_one_delta())
    rec = sync.push(iter(v1), engine, 1)
    assert rec["sync/delta"] == 1.0 and rec["sync/resync/refused"] == 1.0
    assert rec["sync/verified"] == 1.0 and engine.version == 1
    in_process, decided[:] = _trace(decided), []

    # the same loads, as a worker reports them: v0 verified, v1's delta refused, its full verified
    _ctl(fleet, 0, op="synced", version=0, verified=1.0)
    _ctl(fleet, 0, op="resync", reason="refused", version=0)
    _ctl(fleet, 0, op="synced", version=1, verified=1.0)
    assert fleet.counts["resync/refused"] == 1 and fleet.halted is None
    assert _trace(decided) == in_process == [
        (OK, ACCEPT, None), (REFUSED, RESYNC, REFUSED), (OK, ACCEPT, None)]


def test_a_failed_verification_takes_the_same_path_in_process_and_in_the_fleet(model_dir, fleet,
                                                                              decided, monkeypatch):
    v0, v1 = _versions(model_dir, 2)
    engine = LocalEngine(model_dir, precision="int8")
    sync = WeightSync("int8")
    assert sync.push(iter(v0), engine, 0)["sync/verified"] == 1.0
    monkeypatch.setattr(LocalWeights, "load_weights", _corrupt_loads_from(1))
    with pytest.raises(RunHalted) as raised:
        sync.push(iter(v1), engine, 1)  # delta: mismatch -> full: mismatch again -> halt
    assert raised.value is decided[-1][2].error  # the rule's error is what push raises
    assert {h for h, _, _ in decided} == {id(engine)}
    in_process, halt_in_process = _trace(decided), str(raised.value)
    decided[:] = []

    # the same loads, as a worker reports them (qurl/pipeline/worker_sync.py): v0 verified; v1's
    # delta fails verification, then its full resync does too
    who = engine_label(engine)
    _ctl(fleet, 0, op="synced", version=0, verified=1.0)
    for _ in range(2):
        _ctl(fleet, 0, op="synced", version=1, verified=0.0)
        _ctl(fleet, 0, op="resync", reason="mismatch", version=1, engine=who, bad=[LAYER])
    assert {h for h, _, _ in decided} == {0}
    assert _trace(decided) == in_process == [
        (OK, ACCEPT, None), (MISMATCH, RESYNC, MISMATCH), (MISMATCH, HALT, MISMATCH)]
    assert fleet.halted is decided[-1][2].error and fleet.counts["resync/mismatch"] == 2
    assert str(fleet.halted) == halt_in_process.replace(who, f"worker slot 0 ({who})")
    assert halt_in_process.startswith(f"weight sync v1: {who} still differs from the learner's "
                                      f"weights after a full resync, in 1 tensor: {LAYER}; ")
