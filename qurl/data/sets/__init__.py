"""The evaluation sets that ship with qurl, and how a data name in a config becomes a file.

`data.train` / `data.eval` name a file path, or the bare name of a shipped set ("aime24" or
"aime24.jsonl"): the sets the paper evaluates on (AIME24, AMC23, MATH500, Minerva, OlympiadBench) and
GSM8K test, stored next to this file with their source and license in README.md. Training sets are
too large to ship; `qurl fetch NAME` downloads them (qurl/data/download.py) to a path the presets name.
"""
from __future__ import annotations

from pathlib import Path

SETS_DIR = Path(__file__).resolve().parent


def shipped() -> list[str]:
    """Names of the shipped sets (file stems), sorted."""
    return sorted(p.stem for p in SETS_DIR.glob("*.jsonl"))


def resolve_data_path(name: str) -> Path:
    """An existing file path as given, else the shipped set of that name (with or without
    `.jsonl`). FileNotFoundError names what was tried and how to get training sets."""
    p = Path(name)
    if p.is_file():
        return p
    for candidate in (SETS_DIR / name, SETS_DIR / f"{name}.jsonl"):
        if "/" not in name and candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"data file {name!r} not found: not a file, nor a shipped set ({', '.join(shipped())}); "
        f"training sets are downloaded with `qurl fetch` (see docs/data.md)")
