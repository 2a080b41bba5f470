"""The offline GPU check (scripts/gpu_check.py) rehearsed on this CPU: its dry run writes every
section into results.json (the CUDA-only one skipped with its reason, the others' numbers sane),
and the wheel folder it brings along is size-checked, matched to the Python and put first on the
sections' import path."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from qurl.research.bench.gpu_check.runner import SECTIONS
from qurl.research.bench.gpu_check.wheels import (PINS, check_size, download_command, install_site,
                                         wheel_fits)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _check(out: Path, *args: str, timeout: float = 1000) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    proc = _check(out, "--cpu-dry-run", "--wheels", str(out / "no-wheels"))
    return json.loads((out / "results.json").read_text()), proc, out


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the fixture's dry run: ~55 s on 2 idle cores, minutes on busy ones
def test_dry_run_runs_every_section_or_says_why(dry):
    res, proc, out = dry
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    secs = res["sections"]
    assert list(secs) == list(SECTIONS) and res["meta"]["dry_run"] and not res["meta"]["failed"]
    assert secs["cuda_graph"]["status"] == "skipped" and "CUDA" in secs["cuda_graph"]["reason"]
    assert "cuda_graph skipped: needs CUDA" in proc.stdout
    assert {n for n, r in secs.items() if r["status"] == "ok"} == set(SECTIONS) - {"cuda_graph"}
    log = (out / "gpu_check.log").read_text()
    assert all(f"===== {n} (" in log for n in SECTIONS if n != "cuda_graph")
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "results.json"]
    assert res["meta"]["budget_s"] == 900 and res["meta"]["wall_s"] < 900


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dry_run_numbers_are_sane(dry):
    secs = dry[0]["sections"]
    env = secs["env"]["result"]
    assert env["cuda"] is False and env["deps"]["megatron-core"]["version"] == "0.16.1"
    gemm = secs["gemm"]["result"]
    assert len(gemm["rows"]) == 8 * 2 and gemm["fp8_kernel"] == "fp32 emulation"
    for r in gemm["rows"]:
        assert all(r[f"{k}_us"] > 0 for k in ("bf16", "int8", "fp8")), r
        assert r["N"] * 8 in (2048, 1536, 17920, 4608, 3584, 37888) and r["M"] in (1, 64)
    engine = secs["engine"]["result"]  # CPU vs CPU: the same kernels, so the same numbers
    for p in ("bf16", "int8", "fp8"):
        assert engine[p]["equal"] and engine[p]["max_abs"] == 0.0 and engine[p]["logp_mean"] < 0
    learner = secs["learner"]["result"]
    assert set(learner["points"]) == {"128", "256"}
    for pt in learner["points"].values():  # the cost model within a factor of 3 of the measure
        assert pt["row_gb"] > 0 and 1 / 3 < pt["row_ratio"] < 3, pt
        assert pt["step_gb"] > pt["row_gb"] and pt["tokens_per_s"] > 0
    assert learner["points"]["256"]["row_gb"] > learner["points"]["128"]["row_gb"]
    train = secs["train"]["result"]
    # the project's resume tolerance (tests/test_train.py); bit-equal on idle cores here
    assert train["steps"] == [2, 2] and train["max_rel_diff"] <= 1e-5, train
    assert train["weights_max_abs_diff"] <= 1e-5, train
    assert train["checkpoints"]["straight"] == ["step_000001", "step_000002"]
    workers = secs["workers"]["result"]
    assert workers["steps"] == 2 and workers["finite"]


def _fake_wheel(folder: Path, filename: str, module: str, version: str, body: str) -> Path:
    path = folder / filename
    dist = filename.split("-")[0]
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", body)
        z.writestr(f"{dist}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{dist}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    return path


def test_wheel_tags_match_the_python():
    assert wheel_fits("x-1.0-py3-none-any.whl", (3, 12)) is None
    assert wheel_fits("x-1.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                      (3, 12)) is None
    assert wheel_fits("pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl", (3, 13)) is None
    assert "cp311" in wheel_fits("pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl", (3, 11))
    assert "cp312" in wheel_fits("blake3-1.0.11-cp311-cp311-manylinux_2_17_x86_64.whl", (3, 12))
    assert "Linux" in wheel_fits("blake3-1.0.11-cp312-cp312-macosx_11_0_arm64.whl", (3, 12))
    assert wheel_fits("not-a-wheel.zip") == "not a wheel file name"


def test_prep_command_and_size_cap(tmp_path):
    cmd = download_command(tmp_path, "3.11")
    i = cmd.index("--python-version")
    assert cmd[i + 1] == "3.11" and "--only-binary=:all:" in cmd and "--no-deps" in cmd
    assert [a for a in cmd if "==" in a] == [f"{n}=={v}" for n, v in PINS.items()]
    assert "megatron-core==0.16.1" in cmd
    with pytest.raises(ValueError, match="python"):
        download_command(tmp_path, "3.10")
    (tmp_path / "a.whl").write_bytes(b"x" * 3000)
    assert check_size(tmp_path, limit=4000) == 3000
    with pytest.raises(ValueError, match="over the"):
        check_size(tmp_path, limit=2000)


def test_wheels_are_extracted_and_put_first_on_the_path(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "qurlfake-1.0-py3-none-any.whl", "qurlfake", "1.0", "VALUE = 42\n")
    _fake_wheel(wheels, "qurlold-1.0-cp39-cp39-manylinux_2_17_x86_64.whl", "qurlold", "1.0", "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "qurlfake", raising=False)
    got = install_site(wheels, tmp_path / "site")
    assert got["used"] == ["qurlfake-1.0-py3-none-any.whl"] and sys.path[0] == got["site"]
    assert list(got["refused"]) == ["qurlold-1.0-cp39-cp39-manylinux_2_17_x86_64.whl"]
    assert not (tmp_path / "site" / "qurlold").exists()
    import qurlfake

    assert qurlfake.VALUE == 42 and Path(qurlfake.__file__).parent.parent == tmp_path / "site"
    sys.modules.pop("qurlfake", None)
    assert install_site(tmp_path / "absent")["site"] is None


def test_sections_import_the_wheels_before_the_environment(tmp_path):
    """A wheel in the folder shadows the installed package inside the sections' processes: the
    env section reports the wheel's blake3 (a fake 9.9.9) from the extracted folder."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "blake3-9.9.9-py3-none-any.whl", "blake3", "9.9.9", "")
    out = tmp_path / "out"
    proc = _check(out, "--wheels", str(wheels), "--sections", "env", "--cpu-dry-run", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((out / "results.json").read_text())
    site = res["meta"]["wheels"]["site"]
    assert res["meta"]["wheels"]["used"] == ["blake3-9.9.9-py3-none-any.whl"]
    dep = res["sections"]["env"]["result"]["deps"]["blake3"]
    assert dep["version"] == "9.9.9" and dep["from"] == site
    assert list(res["sections"]) == ["env"]


def test_without_cuda_a_real_run_stops_after_env(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    proc = _check(tmp_path, "--sections", "env,gemm,train", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # nothing was measured
    secs = json.loads((tmp_path / "results.json").read_text())["sections"]
    assert secs["env"]["status"] == "ok" and secs["env"]["result"]["cuda"] is False
    assert all(secs[n]["status"] == "skipped" and "no CUDA" in secs[n]["reason"]
               for n in ("gemm", "train"))


def test_the_script_refuses_an_old_python():
    code = ("import sys; sys.version_info = (3, 10, 0); sys.argv = ['gpu_check.py']; "
            f"exec(compile(open({str(SCRIPT)!r}).read(), 'gpu_check.py', 'exec'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs Python >= 3.11" in proc.stderr
