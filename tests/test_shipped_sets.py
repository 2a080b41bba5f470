"""The evaluation sets ship inside the package: bare names resolve to them, each file is small and
declared as package data, Minerva and OlympiadBench load with their own answer fields, and no code
under qurl/ reaches for a ../shared folder a user's clone does not have."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from qurl.config import load_config
from qurl.data.datasets import load_dataset
from qurl.data.download import TRAINING_SETS, target_path
from qurl.data.rewards import extract_answer
from qurl.data.sets import SETS_DIR, resolve_data_path, shipped
from qurl.data.splits import load_eval_sets

ROOT = Path(__file__).resolve().parent.parent
PAPER_SETS = {"aime24", "amc23", "math500", "minerva_math", "olympiadbench", "gsm8k_test"}


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (SETS_DIR / f"{name}.jsonl").read_text().splitlines()]


def test_shipped_sets_are_small_declared_and_documented() -> None:
    assert set(shipped()) == PAPER_SETS
    for name in shipped():
        assert (SETS_DIR / f"{name}.jsonl").stat().st_size < 1 << 20, name
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "*.jsonl" in data["package-data"]["qurl.data.sets"]
    readme = (SETS_DIR / "README.md").read_text()
    for name in shipped():
        assert f"{name}.jsonl" in readme


def test_bare_names_resolve_to_the_shipped_copies(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing of that name here
    assert resolve_data_path("aime24") == resolve_data_path("aime24.jsonl") == SETS_DIR / "aime24.jsonl"
    own = tmp_path / "aime24.jsonl"
    own.write_text('{"problem": "1+1", "answer": "2"}\n')
    assert resolve_data_path("aime24.jsonl") == Path("aime24.jsonl")  # a file given wins
    with pytest.raises(FileNotFoundError, match="qurl fetch"):
        resolve_data_path("deepscaler.json")


def test_minerva_answers_come_from_the_last_boxed_of_the_solution() -> None:
    exs, rows = load_dataset(SETS_DIR / "minerva_math.jsonl"), _rows("minerva_math")
    assert len(exs) == len(rows) == 272
    assert exs[0].answer == "1.6"  # row 0 read by hand: "...=\boxed{1.6} \mathrm{~cm}"
    assert all(ex.answer == extract_answer(r["solution"]) for ex, r in zip(exs, rows))


def test_olympiadbench_answers_drop_the_dollars() -> None:
    exs, rows = load_dataset(SETS_DIR / "olympiadbench.jsonl"), _rows("olympiadbench")
    assert len(exs) == len(rows) == 675
    assert exs[0].answer == "2" and exs[0].uid == f"olympiadbench:{rows[0]['id']}"
    assert all("$" not in ex.answer[:1] + ex.answer[-1:] for ex in exs)
    assert sum(r["final_answer"][0].startswith("$") for r in rows) > 0  # there were some


def test_paper_presets_evaluate_on_shipped_sets_and_fetch_their_training_sets() -> None:
    cfg = load_config("paper-deepscaler-1.5b")
    sets = load_eval_sets(cfg.data, cfg.run.seed)
    assert {k: len(v) for k, v in sets.items()} == {
        "aime24": 30, "amc23": 40, "math500": 500, "minerva_math": 272, "olympiadbench": 675}
    for preset, name in (("paper-deepscaler-1.5b", "deepscaler"), ("paper-dapo-7b", "dapo-math-17k"),
                         ("paper-ppo-gsm8k", "gsm8k_train")):
        assert load_config(preset).data.train == str(target_path(name))
    assert set(TRAINING_SETS) == {"gsm8k_train", "deepscaler", "dapo-math-17k"}


def test_no_code_path_reads_a_shared_folder() -> None:
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "qurl").rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"""["']shared["']|\.\./shared""", line)]
    assert not hits, hits
