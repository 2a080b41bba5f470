"""Reading the final answer out of a text: a model's response, or a data set's worked solution.

- `extract_answer`: the content of the last complete `\\boxed{...}` / `\\fbox{...}` (balanced
  braces, escaped braces not counted; also `\\boxed 5`), else the number after a GSM8K `####`;
  None when there is none (an empty box counts as none).
- `first_box_close`: where the first braced box of a response closes, i.e. where its first answer
  ends and any run-on text begins.
- `gsm8k_final_answer`: the number after the last `####` of a GSM8K worked answer.

Both the data loader (gold answers from worked solutions, datasets.py) and the reward
(answers from responses, rewards.py) read answers this way; neither imports the other
for it.
"""
from __future__ import annotations

import re

__all__ = ["extract_answer", "first_box_close", "gsm8k_final_answer"]

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _brace_partners(text: str, start: int) -> dict[int, int]:
    """Position of every '{' at or after `start` -> position of its matching '}' (unclosed ones are
    absent). One linear pass, so a degenerate response with thousands of unclosed boxes stays cheap.
    A backslash escapes the next character, so `\\{` and `\\}` do not count."""
    partners: dict[int, int] = {}
    stack: list[int] = []
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            partners[stack.pop()] = i
        i += 1
    return partners


def extract_answer(text: str) -> str | None:
    """The final answer of a response: last complete `\\boxed{...}` / `\\fbox{...}` (or `\\boxed 5`),
    else the GSM8K `#### N` number (commas removed), else None. An empty box counts as no answer."""
    boxes = list(_BOX.finditer(text))
    partners = _brace_partners(text, boxes[0].end()) if boxes else {}
    for m in reversed(boxes):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            close = partners.get(i)
            content = None if close is None else text[i + 1 : close]
        else:  # `\\boxed 5`: the argument is the next space/`$`-delimited token
            token = re.match(r"[^\s$]+", text[i:])
            content = token.group(0) if token else None
        if content is not None:
            content = content.strip()
            return content or None
    if "####" in text:
        return gsm8k_final_answer(text) or None
    return None


def first_box_close(text: str) -> int | None:
    """The index of the `}` that closes the first braced `\\boxed{...}` / `\\fbox{...}` of a
    response, None when none closes: where its first answer ends and any run-on begins."""
    for m in _BOX.finditer(text):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            return _brace_partners(text, i).get(i)
    return None


def gsm8k_final_answer(worked: str) -> str | None:
    """The number after the last `####` of a GSM8K worked answer, thousands commas removed."""
    pos = worked.rfind("####")
    if pos < 0:
        return None
    tail = worked[pos + 4 :].strip().splitlines()
    if not tail or not tail[0].strip():
        return None
    return tail[0].strip().replace(",", "").rstrip(".")
