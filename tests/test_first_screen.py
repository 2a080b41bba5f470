"""What a user sees when a run starts: qurl's own lines only, and status lines on lines of their own.

`qurl train` runs one step in a subprocess, its stdout and stderr merged into one pipe as
`qurl train > log 2>&1` would write them. No line may carry a Python warning (a library's, or
qurl's) unless it is listed in INTENDED with its reason. The progress display is checked in both
of its modes (qurl/train/progress.py): a log gets one plain line per step and no carriage return,
a terminal gets the bar with status lines written above it.
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

from qurl.train.progress import Progress

REPO = Path(__file__).resolve().parent.parent

INTENDED: dict[str, str] = {}
"""Warning text (a regular expression) -> why the run prints it on purpose. None today."""


def test_one_step_of_qurl_train_prints_no_warning_and_keeps_eval_lines_whole(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env.pop("MASTER_PORT", None)
    env.pop("PYTHONWARNINGS", None)
    sets = {"run.steps": 1, "run.name": "first", "deploy.dir": tmp_path, "deploy.torch_threads": 1,
            "model.warmstart_steps": 2, "data.train_size": 64, "data.eval_size": 4,
            "rollout.prompts_per_step": 2, "rollout.group_size": 2}
    argv = [sys.executable, "-m", "qurl", "train"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, cwd=str(REPO), timeout=600)
    text = out.stdout
    assert out.returncode == 0, text
    warned = [line for line in text.splitlines() if "Warning" in line
              and not any(re.search(p, line) for p in INTENDED)]
    assert not warned, "\n".join(warned)
    assert "\r" not in text  # a log: no bar frames
    lines = text.splitlines()
    evals = [line for line in lines if "[eval]" in line]  # steps 0 and 1, and the final summary
    assert len(evals) == 3 and all(re.match(r"(final )?\[eval\] step \d", line) for line in evals), evals
    assert any(re.fullmatch(r"qurl: step 1/1 reward=\S+ .*", line) for line in lines), text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_in_a_terminal_and_a_line_per_step_in_a_log(capsys):
    log = io.StringIO()
    p = Progress(3, 1, stream=log)
    p.step({"reward": 0.25, "kl_behav_prox": 0.0125, "tokens": 7})
    p.write("[eval] step 2: greedy 0.500")
    p.close()
    assert log.getvalue() == "qurl: step 2/3 reward=0.25 kl_behav_prox=0.0125\n"
    assert capsys.readouterr().out == "[eval] step 2: greedy 0.500\n"

    term = _Terminal()
    p = Progress(3, 0, stream=term)
    p.step({"reward": 0.5})
    p.write("[eval] step 1: greedy 0.250")
    p.close()
    drawn = term.getvalue()
    assert "\r" in drawn and "1/3" in drawn and "reward=0.5" in drawn  # tqdm's bar, redrawn
    assert "[eval]" not in drawn
    assert capsys.readouterr().out == "[eval] step 1: greedy 0.250\n"
