"""Load question/answer datasets from jsonl or parquet into `Example` records.

RL from verifiable rewards needs only two things per row: the question text that becomes the prompt
and a ground-truth answer string a verifier can compare a response against. Public math sets store
them under different names, so a *preset* maps each known format onto (question, answer):

| fmt          | question field                        | answer field                          |
| ------------ | ------------------------------------- | ------------------------------------- |
| `gsm8k`      | `question`                            | `answer`, the number after `####`     |
| `qa`         | `question`                            | `answer`, a plain string or number    |
| `math`       | `problem` (MATH500, AIME, AMC alike)  | `answer`                              |
| `deepscaler` | `problem`                             | `answer`                              |
| `dapo`       | `prompt` (chat list: the user turn)   | `reward_model.ground_truth`           |
| `minerva`    | `problem`                             | the last `\\boxed{}` of `solution`    |
| `olympiadbench` | `question`                         | `final_answer` (a list; `$` stripped, joined by ", ") |
| `custom`     | `question_field=` (required)          | `answer_field=` (required)            |
| `auto`       | chosen from the first row's keys                                               |

Files: `.jsonl` (one object per line), `.json` (JSON lines or one top-level array of objects) and
`.parquet` (read in batches with pyarrow). Field names are dotted paths into nested dicts
(`reward_model.ground_truth`); explicit `question_field` / `answer_field` override the preset's. A question given as a list of chat messages
(`[{"role": "user", "content": ...}]`) contributes its last user turn. A numeric answer becomes its
shortest exact string (27.0 -> "27").

Invariants:
- uid is stable across runs: `f"{prefix}:{row['id']}"` when the row has an `id`, else
  `f"{prefix}:{row_index}"` (0-based over data rows; blank jsonl lines are skipped and not counted).
  prefix defaults to the file stem. Duplicate uids in one file are an error.
- Every malformed row (bad JSON, missing field, wrong type, empty text) raises DataError (a
  ValueError; qurl.errors.InputError, so the command line prints its one line and exits 2) naming
  the file and the 1-based line (jsonl) or row (parquet) number; nothing is silently dropped.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qurl.data.answers import extract_answer, gsm8k_final_answer
from qurl.errors import InputError

__all__ = ["ANSWER_KINDS", "DataError", "Example", "PRESETS", "load_dataset", "gsm8k_final_answer"]


class DataError(InputError):
    """A data file or row is malformed; the message names the file and line (or row)."""


ANSWER_KINDS = ("math", "number")


@dataclass(frozen=True)
class Example:
    """One verifiable task: `prompt` is the raw question text (no template), `answer` the gold string.

    answer_kind says what the reward accepts as equal to the gold (rewards.py):
    "math" (math-verify's symbolic equivalence: "\\frac{1}{2}" equals "0.5") or "number" (a plain
    numeral only, compared exactly: the kind of a task whose question is itself an expression)."""

    uid: str
    prompt: str
    answer: str
    answer_kind: str = "math"

    def __post_init__(self) -> None:
        if self.answer_kind not in ANSWER_KINDS:
            raise ValueError(f"Example {self.uid!r}: answer_kind must be one of {ANSWER_KINDS}, "
                             f"got {self.answer_kind!r}")


# preset name -> (question field, answer field); aliases share one mapping.
_MATH = ("problem", "answer")
PRESETS: dict[str, tuple[str, str]] = {
    "gsm8k": ("question", "answer"),
    "qa": ("question", "answer"),
    "math": _MATH,
    "math500": _MATH,
    "aime": _MATH,
    "aime24": _MATH,
    "amc": _MATH,
    "amc23": _MATH,
    "deepscaler": _MATH,
    "dapo": ("prompt", "reward_model.ground_truth"),
    "minerva": ("problem", "solution"),
    "olympiadbench": ("question", "final_answer"),
}
_FORMATS = (*PRESETS, "custom", "auto")


def _get_path(row: dict[str, Any], path: str) -> Any:
    """Follow a dotted path through nested dicts; KeyError names the first missing component."""
    cur: Any = row
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(part)
        cur = cur[part]
    return cur


def _question_text(value: Any, field: str) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):
        # A chat transcript: the question is what the user said last.
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if not users or not isinstance(users[-1].get("content"), str):
            raise ValueError(f"field '{field}' is a list without a user message with string content")
        text = users[-1]["content"]
    else:
        raise ValueError(f"field '{field}' has type {type(value).__name__}, expected str or chat list")
    if not text.strip():
        raise ValueError(f"field '{field}' is empty")
    return text


def _answer_text(value: Any, field: str) -> str:
    if isinstance(value, bool):  # bool is an int subclass: reject it before the int branch
        raise ValueError(f"field '{field}' has type bool, expected str or number")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"field '{field}' is {value}, not a finite number")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"field '{field}' is empty")
        return value.strip()
    raise ValueError(f"field '{field}' has type {type(value).__name__}, expected str or number")


def _detect_format(row: dict[str, Any]) -> str:
    if "prompt" in row and isinstance(row.get("reward_model"), dict):
        return "dapo"
    if "problem" in row and "answer" in row:
        return "math"
    if "question" in row and isinstance(row.get("answer"), str) and "####" in row["answer"]:
        return "gsm8k"
    if "question" in row and isinstance(row.get("answer"), (str, int, float)) and \
            not isinstance(row.get("answer"), bool):
        return "qa"  # plain question / answer strings, the common layout of user math sets
    if "problem" in row and "solution" in row:
        return "minerva"
    if "question" in row and isinstance(row.get("final_answer"), list):
        return "olympiadbench"
    raise ValueError(
        f"cannot detect the format from the first row's keys {sorted(row)}; pass fmt= or "
        "question_field=/answer_field="
    )


def _iter_json_array(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array, each with the 1-based line where it starts."""
    decoder = json.JSONDecoder()
    ws = re.compile(r"\s*")
    pos = ws.match(text, text.index("[") + 1).end()
    line, counted = 1, 0  # line number of `pos`, maintained incrementally (linear overall)

    def line_at(p: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, p)
        counted = p
        return line

    if text.startswith("]", pos):
        return
    while True:
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: bad JSON ({e.msg} at column {e.colno})") from None
        yield line_at(pos), value
        pos = ws.match(text, end).end()
        if text.startswith(",", pos):
            pos = ws.match(text, pos + 1).end()
        elif text.startswith("]", pos):
            return
        else:
            raise DataError(f"{path}:{line_at(pos)}: bad JSON (expected ',' or ']' between array elements)")


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: bad JSON ({e.msg} at column {e.colno})") from None


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq  # lazy: only parquet users pay for pyarrow

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for a corrupt file
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    rowno = 0
    for batch in pf.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            rowno += 1
            yield rowno, row


def load_dataset(
    path: str | Path,
    fmt: str = "auto",
    *,
    question_field: str | None = None,
    answer_field: str | None = None,
    uid_prefix: str | None = None,
    limit: int | None = None,
) -> list[Example]:
    """Read a `.jsonl` or `.parquet` file into Examples, in file order.

    fmt: one of PRESETS, "custom" (needs both field arguments) or "auto" (from the first row's keys).
    limit: stop after this many examples (rows past it are not read, so not validated).
    Errors name the file and the 1-based line/row: `path:LINE: field 'answer' missing`.
    """
    path = Path(path)
    if fmt not in _FORMATS:
        raise ValueError(f"unknown dataset fmt {fmt!r}; expected one of {', '.join(_FORMATS)}")
    if fmt == "custom" and (question_field is None or answer_field is None):
        raise ValueError("fmt='custom' needs both question_field= and answer_field=")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        # A .json file may be one JSON array (DeepScaleR ships so) or JSON lines.
        with path.open("r", encoding="utf-8") as fh:
            head = fh.read(4096).lstrip()
        if suffix == ".json" and head.startswith("["):
            rows = _iter_json_array(path, path.read_text(encoding="utf-8"))
        else:
            rows = _iter_jsonl(path)
        unit = "line"
    elif suffix in (".parquet", ".pq"):
        rows, unit = _iter_parquet(path), "row"
    else:
        raise DataError(f"{path}: unsupported extension {suffix!r} (use .jsonl, .json or .parquet)")
    prefix = uid_prefix if uid_prefix is not None else path.stem

    out: list[Example] = []
    seen: dict[str, int] = {}
    q_field = a_field = ""
    resolved = fmt
    for index, (lineno, row) in enumerate(rows):
        if limit is not None and index >= limit:
            break
        where = f"{path}:{lineno}" if unit == "line" else f"{path}: row {lineno}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if index == 0:
            if resolved == "auto" and (question_field is None or answer_field is None):
                try:
                    resolved = _detect_format(row)
                except ValueError as e:
                    raise DataError(f"{where}: {e}") from None
            preset = PRESETS.get(resolved, ("", ""))
            q_field = question_field or preset[0]
            a_field = answer_field or preset[1]
        try:
            example = _make_example(row, q_field, a_field, resolved, prefix, index)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        if example.uid in seen:
            raise DataError(f"{where}: duplicate uid {example.uid!r} (first at data row {seen[example.uid] + 1})")
        seen[example.uid] = index
        out.append(example)
    return out


def _make_example(
    row: dict[str, Any], q_field: str, a_field: str, fmt: str, prefix: str, index: int
) -> Example:
    values = []
    for field in (q_field, a_field):
        try:
            values.append(_get_path(row, field))
        except KeyError as e:
            raise ValueError(f"field '{field}' missing (no key {e.args[0]!r})") from None
    question = _question_text(values[0], q_field)
    raw_answer = values[1]
    if fmt == "gsm8k" and isinstance(raw_answer, str):
        final = gsm8k_final_answer(raw_answer)
        if final is None:
            raise ValueError(f"field '{a_field}' has no '#### <answer>' line")
        raw_answer = final
    elif fmt == "minerva" and isinstance(raw_answer, str):
        final = extract_answer(raw_answer)
        if final is None:
            raise ValueError(f"field '{a_field}' has no \\boxed{{}} answer")
        raw_answer = final
    elif fmt == "olympiadbench":
        if not isinstance(raw_answer, list) or not raw_answer or \
                not all(isinstance(a, str) and a.strip() for a in raw_answer):
            raise ValueError(f"field '{a_field}' must be a non-empty list of answer strings")
        raw_answer = ", ".join(a.strip().strip("$").strip() for a in raw_answer)
    answer = _answer_text(raw_answer, a_field)
    row_id = row.get("id")
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, (str, int))):
        raise ValueError(f"field 'id' has type {type(row_id).__name__}, expected str or int")
    uid = f"{prefix}:{row_id if row_id is not None else index}"
    return Example(uid=uid, prompt=question, answer=answer)
