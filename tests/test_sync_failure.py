"""Issue 60 item 3: a weight sync that fails verification twice stops the run in one line, and the
run resumes from its last checkpoint.

The fault is a persistent corruption of the engine: after every load of a version >= 2 one 8-bit
code of the rollout engine is changed behind the sync's back (as a broken loader would), so the
digest check fails, the full resync fails again, and `qurl train` must print ONE line naming the
engine and the tensor and exit 2 — with nothing trained on the unverified version (no record, no
checkpoint past step 1) — and `qurl train --resume` then finishes the run. The async side is the
fleet's bookkeeping (qurl/pipeline/fleet.py): a worker's second mismatch in a row sets the one-line
error the controller raises, a verified sync in between forgives the first, and prompts a failed
sync made a worker abandon are counted (`unverified_redone`).
"""
from __future__ import annotations

import json

import pytest
import torch

from pipeline_helpers import cli_sets, tiny_sets
from qurl.cli import main
from qurl.engines.local_weights import LocalWeights
from qurl.errors import RunHalted

LAYER = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def runs_root(runs_dir):
    from pipeline_helpers import use_free_dist_port

    use_free_dist_port()
    return runs_dir("runs")


def _corrupt_from(version: int):
    real = LocalWeights.load_weights

    def load(self, chunks, v, **kw):
        real(self, chunks, v, **kw)
        if v >= version and LAYER in self._qlinears:
            with torch.no_grad():
                code = self._tensors[LAYER].view(-1)
                code[0] = code[0] + 1 if code[0] < 127 else code[0] - 1
    return load


@pytest.mark.slow  # two short `qurl train` runs: minutes on a loaded 2-core machine
@pytest.mark.timeout(600)
def test_second_failed_verification_stops_qurl_train_in_one_line_and_resume_finishes(
        runs_root, monkeypatch, capsys):
    sets = tiny_sets(runs_root, "halt", 2, **{"rollout.precision": "int8", "data.eval_size": 4})
    run_dir = runs_root / "halt"
    with monkeypatch.context() as m:
        m.setattr(LocalWeights, "load_weights", _corrupt_from(2))
        rc = main(["train", *cli_sets(sets)])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("qurl: error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "weight sync v2: LocalEngine (int8) still differs" in lines[0]
    assert f"in 1 tensor: {LAYER}" in lines[0] and "--resume" in lines[0]
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("kind") == "train"] == [1]  # step 2: not kept
    assert sorted(p.name for p in (run_dir / "ckpt").glob("step_*")) == ["step_000001"]

    assert main(["train", "--resume", str(run_dir)]) == 0  # the fault is gone: it finishes
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["sync/verified"] == 1.0 for r in train)


# ------------------------------------------------------------------ the async fleet

@pytest.fixture
def fleet(tmp_path):
    from pipeline_helpers import fleet_of, tiny_cfg

    cfg = tiny_cfg(tmp_path, "fleet", 1, **{"deploy.engines": 2})
    (tmp_path / "fleet").mkdir()
    f = fleet_of(cfg, tmp_path / "fleet", vocab_size=100, spawn=False)
    yield f
    f.close()


def _ctl(fleet, slot: int, **meta) -> None:
    fleet._on_control({"slot": slot, "session": fleet.session, **meta})


def _mismatch(fleet, slot: int, version: int) -> None:
    _ctl(fleet, slot, op="synced", version=version, verified=0.0)
    _ctl(fleet, slot, op="resync", reason="mismatch", version=version, engine="LocalEngine (int8)",
         bad=[LAYER, "model.layers.1.mlp.up_proj.weight"])


def test_a_workers_second_mismatch_in_a_row_halts_the_run_in_one_line(fleet):
    _mismatch(fleet, 0, 3)
    assert fleet.halted is None and fleet.need_full  # the first: resync in full
    _ctl(fleet, 0, op="synced", version=3, verified=1.0)  # the full sync verified: forgiven
    _mismatch(fleet, 0, 4)
    _mismatch(fleet, 1, 4)  # another slot's first
    assert fleet.halted is None
    _mismatch(fleet, 0, 4)  # slot 0's full resync of v4 failed too
    assert isinstance(fleet.halted, RunHalted)
    msg = str(fleet.halted)
    assert "\n" not in msg and msg.startswith("weight sync v4: worker slot 0 (LocalEngine (int8))")
    assert f"in 2 tensors: {LAYER}, model.layers.1.mlp.up_proj.weight" in msg
    assert fleet.counts["resync/mismatch"] == 4


def test_prompts_abandoned_at_a_failed_sync_are_counted(fleet):
    _ctl(fleet, 0, op="redone", prompts=3)
    _ctl(fleet, 1, op="redone", prompts=2)
    _ctl(fleet, 1, op="redone", prompts="x")  # malformed: not counted
    assert fleet.counts["unverified_redone"] == 5
