"""Turn a raw question into the text the policy is conditioned on.

Four templates:
- "plain": the question unchanged. For synthetic tasks whose question already ends where the answer
  starts (e.g. "12+34="), and for tiny character-level models that never saw instructions.
- "boxed": the question plus the instruction the Qwen-Math / DeepScaleR / DAPO recipes use, so the
  model puts its final answer in `\\boxed{}` where `rewards.extract_answer` looks for it.
- "chat": the "boxed" text as a single user turn, rendered with the tokenizer's own chat template and
  the assistant generation prompt appended (what an instruction-tuned model expects).
- "chat-1shot": the chat template with one worked exchange before the question (`ONE_SHOT`: a
  short arithmetic question answered as `2+5-4 = 3. \\boxed{3}`) and a short instruction. Few-shot
  prompting is how small instruction models are usually evaluated on math; here it teaches the
  answer format without a warm start: SmolLM2-135M-Instruct boxes 0 of 32 greedy answers with the
  "chat" template and 32 of 32 with this one (docs/real_model.md).

In both chat templates a bare arithmetic expression ending in "=" (the synthetic task's questions,
"7-3+5=") is asked as "What is 7-3+5?": an instruction model reads a dangling "=" as noise.

Invariant: rendering is a pure function of (question, template, tokenizer's chat template); the
training loop and evaluation must use the same template or accuracy numbers are not comparable.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["BOXED_INSTRUCTION", "ONE_SHOT", "SHORT_INSTRUCTION", "TEMPLATES", "render_prompt"]

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SHORT_INSTRUCTION = "Put your final answer within \\boxed{}."
ONE_SHOT = ("What is 2+5-4?", "2+5-4 = 3. \\boxed{3}")  # (question, answer) of chat-1shot
TEMPLATES = ("plain", "chat", "boxed", "chat-1shot")
_EXPRESSION = re.compile(r"[0-9+\-*() ]+=")


def _as_question(question: str) -> str:
    """'7-3+5=' -> 'What is 7-3+5?'; any other text unchanged."""
    return f"What is {question[:-1]}?" if _EXPRESSION.fullmatch(question) else question


def _chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("chat templates need a tokenizer with apply_chat_template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise ValueError(f"tokenizer.apply_chat_template returned {type(text).__name__}, expected str")
    return text


def render_prompt(question: str, template: str = "plain", tokenizer: Any = None) -> str:
    """Render `question` with `template` ("plain" | "boxed" | "chat" | "chat-1shot").

    tokenizer: needed only for the chat templates; any object with the Hugging Face
    `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` method.
    """
    if not isinstance(question, str):
        raise ValueError(f"question must be a str, got {type(question).__name__}")
    if template == "plain":
        return question
    if template == "boxed":
        return f"{question}\n{BOXED_INSTRUCTION}"
    if template == "chat":
        return _chat(tokenizer, [{"role": "user",
                                  "content": f"{_as_question(question)}\n{BOXED_INSTRUCTION}"}])
    if template == "chat-1shot":
        shot_q, shot_a = ONE_SHOT
        return _chat(tokenizer, [
            {"role": "user", "content": f"{shot_q} {SHORT_INSTRUCTION}"},
            {"role": "assistant", "content": shot_a},
            {"role": "user", "content": f"{_as_question(question)} {SHORT_INSTRUCTION}"}])
    raise ValueError(f"unknown prompt template {template!r}; expected one of {', '.join(TEMPLATES)}")
