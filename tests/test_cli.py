"""The command line as a user meets it: `python -m qurl` is the `qurl` script."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def qurl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python -m qurl ARGS` with this checkout first on the path; capture both streams."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env.pop("MASTER_PORT", None)
    return subprocess.run([sys.executable, "-m", "qurl", *args], capture_output=True, text=True,
                          env=env, cwd=str(REPO), timeout=timeout)


def test_python_dash_m_qurl_is_the_cli():
    out = qurl("--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: qurl ")
    usage = out.stdout.split("\n\n")[0]  # argparse wraps a long usage line
    for cmd in ("train", "eval", "export", "report", "compare", "bench", "launch"):
        assert cmd in usage
    bad = qurl("no-such-command")
    assert bad.returncode == 2 and "invalid choice: 'no-such-command'" in bad.stderr


# ---------------------------------------------------------------- bad input: exit 2, one line

def one_error_line(out: subprocess.CompletedProcess) -> str:
    """The run failed with status 2 and printed exactly one line, the error (no traceback)."""
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qurl: error: "), out.stderr
    return lines[0]


def bad_jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2"}\n'
                    '{"problem": "2+2", "answer": "4"}\n'
                    '{"problem": "3+3", "answer": }\n')
    return path


def test_malformed_data_row_exits_2_naming_file_and_line(tmp_path):
    line = one_error_line(qurl("train", "--set", f"data.train={bad_jsonl(tmp_path)}",
                               "--set", f"deploy.dir={tmp_path}"))
    assert f"{tmp_path / 'bad.jsonl'}:3: bad JSON" in line
    assert not (tmp_path / "train").exists()  # refused before a run directory was made


def test_bad_config_value_exits_2_naming_the_field(tmp_path):
    line = one_error_line(qurl("train", "--set", "rollout.precision=int4",
                               "--set", f"deploy.dir={tmp_path}"))
    assert "rollout.precision='int4'" in line


@pytest.mark.slow
def test_two_ranks_error_found_on_rank_0_exits_2_in_one_line(tmp_path):
    """learner.tp=2 runs as two spawned ranks; rank 0 refuses the run directory after the ranks
    joined their process group (a fresh run over an existing one): one line, status 2."""
    (tmp_path / "busy" / "ckpt").mkdir(parents=True)
    (tmp_path / "busy" / "ckpt" / "latest").write_text("step_000001")
    line = one_error_line(qurl("train", "--set", "learner.tp=2", "--set", f"deploy.dir={tmp_path}",
                               "--set", "run.name=busy", "--set", "deploy.torch_threads=1"))
    assert f"{tmp_path / 'busy'} already holds a run" in line


@pytest.mark.slow
def test_torchrun_two_ranks_bad_data_one_qurl_line_status_2(tmp_path):
    """Under torchrun each rank is its own `qurl train`: rank 0 exits 2 naming the bad row, rank 1
    (same error) leaves it the word and is stopped by torchrun. torchrun then prints its own
    failure report and exits 1: not qurl's output."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env.pop("MASTER_PORT", None)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "qurl", "train", "--set", "learner.tp=2",
         "--set", f"data.train={bad_jsonl(tmp_path)}", "--set", f"deploy.dir={tmp_path}"],
        capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300)
    ours = [ln for ln in out.stderr.splitlines() if "qurl: error:" in ln]
    assert len(ours) == 1 and f"{tmp_path / 'bad.jsonl'}:3: bad JSON" in ours[0], out.stderr
    report = out.stderr[out.stderr.index("Root Cause"):]  # torchrun's report: rank 0 exited 2
    assert "rank      : 0" in report and "exitcode  : 2" in report, out.stderr
    assert not _qurl_frames(out.stderr), out.stderr  # no traceback through qurl's code


def _qurl_frames(stderr: str) -> list[str]:
    """Traceback frames (`File "...", line N`) in qurl's own package: judged by the package's
    path, not by the text `/qurl/`, which any checkout cloned into a folder named qurl (and its
    interpreter's path) contains."""
    pkg = str(REPO / "qurl") + os.sep
    return [f for f in re.findall(r'File "([^"]+)", line \d+', stderr)
            if os.path.realpath(f).startswith(pkg)]


def test_qurl_frames_are_found_by_the_package_path_not_by_the_folder_name():
    inside = f'  File "{REPO / "qurl" / "cli.py"}", line 3, in main'
    venv = f'  File "/home/u/qurl/.venv/lib/python3.11/site-packages/torch/run.py", line 9, in x'
    assert _qurl_frames(f"Traceback (most recent call last):\n{venv}\n{inside}\n") == [
        str(REPO / "qurl" / "cli.py")]
    assert _qurl_frames(f"/home/u/qurl/.venv/bin/python failed\n{venv}\n") == []


def _free_port() -> int:
    from qurl.learner.dist import free_port

    return free_port()


def test_bench_sync_delta_refuses_an_unknown_shape():
    line = one_error_line(qurl("bench", "sync", "--delta", "--delta-shapes", "qwen2.5-0.5b,gpt5"))
    assert "--delta-shapes: unknown 'gpt5'" in line
