"""Checkpoints that survive damage: every file of a real checkpoint is checksummed when written; a
truncated or altered file makes resume fall back to the newest intact checkpoint (warning names
the file) or refuse with one line when none is intact; pre-manifest checkpoints still resume."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from pipeline_helpers import tiny_cfg, use_free_dist_port
from test_cli import qurl
from test_train import assert_records_close, comparable

from qurl.checkpoint.checksums import MANIFEST, damage, hash_file, read_manifest
from qurl.checkpoint.rundir import CheckpointDir
from qurl.errors import CheckpointError
from qurl.commands.train import train
from qurl.train.metrics_log import read_metrics

pytestmark = pytest.mark.slow  # one real 2-step run (base model from the session cache) + a resume

STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def _keep_dist_env():
    """In-process runs here set MASTER_ADDR/PORT and keep that port bound; later modules' `qurl`
    subprocesses (test_compare's arms) inherit the environment, so put it back as it was."""
    before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def run(runs_dir):
    """A finished 2-step sync run with a checkpoint after each step (step_000001, step_000002)."""
    use_free_dist_port()
    root = runs_dir("ckpt")
    train(tiny_cfg(root, "r", STEPS, **{"deploy.keep_ckpts": 2}))
    return root / "r"


def _copy(run_dir: Path, dst: Path) -> Path:
    shutil.copytree(run_dir, dst, symlinks=True)
    return dst


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_the_checksum_of_its_bytes(run):
    ckpts = CheckpointDir(run).checkpoints()
    assert [p.name for p in ckpts] == ["step_000001", "step_000002"]
    for ckpt in ckpts:
        listed = read_manifest(ckpt)
        on_disk = {p.name for p in ckpt.iterdir()} - {MANIFEST}
        # the kinds of file a tp=1 checkpoint holds: model shard, optimizer state, step/cursor/RNG
        assert set(listed) == on_disk == {"model_rank0.pt", "optim_rank0.pt", "state.pt"}
        for name, entry in listed.items():  # taken while writing, equal to the bytes on disk
            assert entry == hash_file(ckpt / name), name
        assert damage(ckpt) is None


@pytest.mark.parametrize("hurt", [truncate, flip], ids=["truncate", "flip"])
def test_each_damaged_file_falls_back_then_refuses(run, tmp_path, caplog, hurt):
    """For each file of the checkpoint (and the manifest): damaged in the newest checkpoint, resume
    takes the previous one and the warning names the file; damaged in both, resume refuses with
    one line naming both."""
    names = sorted(p.name for p in (run / "ckpt" / "step_000002").iterdir())
    assert MANIFEST in names and len(names) == 4
    for name in names:
        d = _copy(run, tmp_path / f"{hurt.__name__}-{name}")
        ckpts = CheckpointDir(d)
        hurt(d / "ckpt" / "step_000002" / name)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qurl.checkpoint.rundir"):
            assert ckpts.latest() == d / "ckpt" / "step_000001"
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1 and f"step_000002/{name}" in warned[0], warned
        print(f"{hurt.__name__} step_000002/{name}: resume falls back to step_000001 | {warned[0]}")

        hurt(d / "ckpt" / "step_000001" / name)
        with pytest.raises(CheckpointError) as e:
            ckpts.latest()
        msg = str(e.value)
        assert "\n" not in msg and "no intact checkpoint" in msg
        assert f"step_000002/{name}" in msg and f"step_000001/{name}" in msg
        print(f"{hurt.__name__} both/{name}: refused | {msg}")


def test_resume_after_fallback_is_exact(run, tmp_path, caplog):
    """Damage the newest checkpoint's optimizer: resuming trains step 2 again from step 1's
    checkpoint and reproduces the uninterrupted run's step-2 record; the new step 2 is intact."""
    d = _copy(run, tmp_path / "r2")
    flip(d / "ckpt" / "step_000002" / "optim_rank0.pt")
    cfg = tiny_cfg(tmp_path, "r2", STEPS, **{"deploy.keep_ckpts": 2})
    use_free_dist_port()
    with caplog.at_level(logging.WARNING, logger="qurl.checkpoint.rundir"):
        train(cfg, resume=True)
    assert any("step_000002/optim_rank0.pt" in r.getMessage() for r in caplog.records)

    again = read_metrics(d / "metrics.jsonl")
    assert [r["step"] for r in again if r["kind"] == "train"] == [1, 2]
    assert_records_close(comparable(again), comparable(read_metrics(run / "metrics.jsonl")))
    newest = d / "ckpt" / "step_000002"
    assert damage(newest) is None
    assert torch.load(newest / "state.pt", weights_only=False)["step"] == 2


def test_checkpoint_without_manifest_resumes_unverified(run, tmp_path, caplog):
    d = _copy(run, tmp_path / "old")
    for ckpt in CheckpointDir(d).checkpoints():
        (ckpt / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="qurl.checkpoint.rundir"):
        assert CheckpointDir(d).latest() == d / "ckpt" / "step_000002"
    assert any("no manifest.json" in r.getMessage() for r in caplog.records)
    (d / "ckpt" / "step_000002" / "state.pt").unlink()  # the one file every checkpoint has
    assert CheckpointDir(d).latest() == d / "ckpt" / "step_000001"


def test_cli_refuses_in_one_line_when_no_checkpoint_is_intact(run, tmp_path):
    d = _copy(run, tmp_path / "dead")
    for ckpt in CheckpointDir(d).checkpoints():
        truncate(ckpt / "model_rank0.pt")
    out = qurl("train", "--resume", str(d))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qurl: error: ") and "model_rank0.pt" in lines[0], out.stderr
    print(lines[0])


def _save_on_two_ranks(rank: int, world_size: int, tmp: str) -> dict | None:
    """What save_checkpoint does across ranks: each writes its own file (hashed while written), the
    per-rank checksums are gathered on rank 0, which commits the manifest."""
    import torch.distributed as dist

    from qurl.checkpoint.checksums import save_torch
    from qurl.learner.dist import gather_object

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        sums = save_torch({"rank": torch.full((1000,), float(rank))}, Path(tmp) / f"shard{rank}.pt")
        per_rank = gather_object({f"shard{rank}.pt": sums})
        if rank != 0:
            return None
        merged = {name: s for part in per_rank for name, s in part.items()}
        return {"per_rank": per_rank, "listed": CheckpointDir(Path(tmp).parent.parent).commit(
            Path(tmp), merged).name}
    finally:
        dist.destroy_process_group()


def test_two_ranks_checksums_gathered_into_one_manifest(tmp_path):
    from qurl.learner.dist import spawn

    ckpts = CheckpointDir(tmp_path)
    tmp = ckpts.begin(7)
    out = spawn(_save_on_two_ranks, 2, str(tmp))[0]
    assert [list(p) for p in out["per_rank"]] == [["shard0.pt"], ["shard1.pt"]]
    final = tmp_path / "ckpt" / out["listed"]
    listed = read_manifest(final)
    assert set(listed) == {"shard0.pt", "shard1.pt"}
    for name, entry in listed.items():
        assert entry == hash_file(final / name)
    assert ckpts.latest() == final


def test_resume_after_a_kill_mid_record_is_exact(run, tmp_path, caplog):
    """Killed while writing step 2's train record (before its checkpoint): metrics.jsonl ends in
    half a line. Resume warns once, drops it, trains step 2 again from step 1's checkpoint and
    ends with the uninterrupted run's records."""
    d = _copy(run, tmp_path / "r3")
    shutil.rmtree(d / "ckpt" / "step_000002")
    lines = (d / "metrics.jsonl").read_text().splitlines(keepends=True)
    step2 = next(i for i, ln in enumerate(lines) if '"step": 2' in ln and '"train"' in ln)
    (d / "metrics.jsonl").write_text("".join(lines[:step2]) + lines[step2][:len(lines[step2]) // 2])
    cfg = tiny_cfg(tmp_path, "r3", STEPS, **{"deploy.keep_ckpts": 2})
    use_free_dist_port()
    with caplog.at_level(logging.WARNING, logger="qurl.train.metrics_log"):
        train(cfg, resume=True)
    assert sum("half-written" in r.getMessage() for r in caplog.records) == 1
    again = read_metrics(d / "metrics.jsonl")
    assert [r["step"] for r in again if r["kind"] == "train"] == [1, 2]
    assert_records_close(comparable(again), comparable(read_metrics(run / "metrics.jsonl")))
