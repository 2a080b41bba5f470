"""A study's records packed into `<out>.tar.xz` (qurl/research/studies/records.py): deterministic archives,
loose and packed records read alike, tables written back into the archive, and the committed
studies of docs/study read from their archives as they were read loose."""
from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest

from qurl.research.studies.records import (archive_path, open_records, pack, read_archive, unpack,
                                  write_archive, write_records)

DOCS_STUDY = Path(__file__).resolve().parent.parent / "docs" / "study"


def _study(out: Path) -> None:
    """A study directory as `qurl study ablation` leaves it: pages, a plot, records."""
    for name, text in {"ablation.md": "# page\n", "arm/seed0/config.toml": "[run]\nsteps = 1\n",
                       "arm/seed0/metrics.jsonl": '{"kind": "eval", "step": 0}\n',
                       "arm/seed1/base.json": "{}\n", "ablation.csv": "a,b\r\n1,2\r\n",
                       "evals/x.json": "{}\n"}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text, newline="")
    (out / "ablation_step.png").write_bytes(b"\x89PNG")


def test_pack_keeps_pages_moves_records_and_rebuilds_to_the_same_bytes(tmp_path):
    out = tmp_path / "study"
    _study(out)
    archive = pack(out)
    assert archive == tmp_path / "study.tar.xz"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "ablation.md", "ablation_step.png"]  # records gone, their emptied directories too
    with tarfile.open(archive) as tar:
        infos = tar.getmembers()
    assert [i.name for i in infos] == sorted(i.name for i in infos) == [
        "ablation.csv", "arm/seed0/config.toml", "arm/seed0/metrics.jsonl", "arm/seed1/base.json",
        "evals/x.json"]
    assert {(i.mtime, i.uid, i.gid, i.uname, i.gname, i.mode) for i in infos} == {
        (0, 0, 0, "", "", 0o644)}
    blob = archive.read_bytes()
    unpack(out)
    assert (out / "ablation.csv").read_bytes() == b"a,b\r\n1,2\r\n"  # bytes as they were
    archive.unlink()
    assert pack(out).read_bytes() == blob  # the same records, the same archive


def test_records_read_loose_and_packed_alike_loose_first(tmp_path):
    out = tmp_path / "study"
    _study(out)
    pack(out)
    rec = open_records(out)
    assert rec.archive == archive_path(out)
    assert rec.read_text("arm/seed0/config.toml") == "[run]\nsteps = 1\n"
    assert "arm/seed1/base.json" in rec.names() and "ablation.md" in rec.names()
    arm = open_records(out / "arm" / "seed0")  # a directory inside the study, not on disk
    assert arm.names() == ["config.toml", "metrics.jsonl"] and arm.exists("metrics.jsonl")
    with arm.on_disk("config.toml", "metrics.jsonl") as d:
        assert (d / "config.toml").read_text() == "[run]\nsteps = 1\n"
    (out / "arm" / "seed0").mkdir(parents=True)
    (out / "arm" / "seed0" / "config.toml").write_text("[run]\nsteps = 2\n")  # committed anew
    assert open_records(out / "arm" / "seed0").read_text("config.toml") == "[run]\nsteps = 2\n"
    with pytest.raises(FileNotFoundError, match="nor in"):
        arm.read_bytes("final_eval.json")
    assert open_records(tmp_path / "elsewhere").archive is None


def test_tables_of_a_packed_study_go_into_its_archive(tmp_path):
    out = tmp_path / "study"
    _study(out)
    archive = pack(out)
    before = archive.read_bytes()
    assert write_records(out, {"ablation.csv": "a,b\r\n1,2\r\n"}) == [archive]
    assert archive.read_bytes() == before and not (out / "ablation.csv").exists()
    write_records(out, {"ablation.csv": "a,b\r\n3,4\r\n", "ablation_pairs.csv": "c\r\n"})
    assert read_archive(archive)["ablation.csv"] == b"a,b\r\n3,4\r\n"
    assert open_records(out).read_text("ablation_pairs.csv") == "c\r\n"
    loose = tmp_path / "loose"
    assert write_records(loose, {"t.csv": "x\r\n"}) == [loose / "t.csv"]
    assert (loose / "t.csv").read_bytes() == b"x\r\n"


def test_unpack_refuses_a_member_outside_the_study(tmp_path):
    write_archive(tmp_path / "s.tar.xz", {"../evil.txt": b"x"})
    with pytest.raises(ValueError, match="outside"):
        unpack(tmp_path / "s")


@pytest.mark.parametrize("study", ["smollm2_sft_threads", "smollm2_sft_lr1e-5_fp32ws"])
def test_a_committed_study_reads_the_same_from_its_archive_and_loose(study, tmp_path):
    """qurl study ablation --table-only reads what `committed`/`starts` return: the same from
    docs/study/<study>.tar.xz as from its records extracted loose; the archive rebuilds to its
    committed bytes."""
    from qurl.research.studies.store import committed, starts

    packed = DOCS_STUDY / study
    if not archive_path(packed).is_file():
        pytest.skip(f"{archive_path(packed)}: not packed in this checkout")
    loose = tmp_path / study
    loose.mkdir()
    for f in packed.iterdir() if packed.is_dir() else []:
        shutil.copy(f, loose / f.name)
    shutil.copy(archive_path(packed), archive_path(loose))
    unpack(loose)
    archive_path(loose).unlink()
    want, want_starts = committed(loose), starts(loose)
    got = committed(packed)
    assert want and list(got) == list(want)
    assert all(got[k][1] == want[k][1] and got[k][0] == want[k][0] for k in want)
    assert starts(packed) == want_starts
    assert pack(loose).read_bytes() == archive_path(packed).read_bytes()


def test_trajectories_and_final_eval_read_a_packed_arm(tmp_path, capsys):
    from qurl.research.studies.final_eval import read_final
    from qurl.research.studies.trajectories import main

    study = DOCS_STUDY / "smollm2_sft_threads"
    if not archive_path(study).is_file():
        pytest.skip("not packed in this checkout")
    arm = study / "bf16-ppo" / "seed4"
    assert main([str(arm)]) == 0
    assert "| — | " + str(arm) + " | 40 |" in capsys.readouterr().out
    assert main([str(arm / "metrics.jsonl")]) == 0
    assert read_final(arm)["step"] == 40
    assert main([str(study / "bf16-ppo" / "seed9")]) == 2
