"""Turn a raw question into the text the policy is conditioned on.

Three templates:
- "plain": the question unchanged. For synthetic tasks whose question already ends where the answer
  starts (e.g. "12+34="), and for tiny character-level models that never saw instructions.
- "boxed": the question plus the instruction the Qwen-Math / DeepScaleR / DAPO recipes use, so the
  model puts its final answer in `\\boxed{}` where `rewards.extract_answer` looks for it.
- "chat": the "boxed" text as a single user turn, rendered with the tokenizer's own chat template and
  the assistant generation prompt appended (what an instruction-tuned model expects).

Invariant: rendering is a pure function of (question, template, tokenizer's chat template); the
training loop and evaluation must use the same template or accuracy numbers are not comparable.
"""
from __future__ import annotations

from typing import Any

__all__ = ["BOXED_INSTRUCTION", "TEMPLATES", "render_prompt"]

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATES = ("plain", "chat", "boxed")


def render_prompt(question: str, template: str = "plain", tokenizer: Any = None) -> str:
    """Render `question` with `template` ("plain" | "boxed" | "chat").

    tokenizer: needed only for "chat"; any object with the Hugging Face
    `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` method.
    """
    if not isinstance(question, str):
        raise ValueError(f"question must be a str, got {type(question).__name__}")
    if template == "plain":
        return question
    boxed = f"{question}\n{BOXED_INSTRUCTION}"
    if template == "boxed":
        return boxed
    if template == "chat":
        if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError("template 'chat' needs a tokenizer with apply_chat_template")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": boxed}], add_generation_prompt=True, tokenize=False
        )
        if not isinstance(text, str):
            raise ValueError(f"tokenizer.apply_chat_template returned {type(text).__name__}, expected str")
        return text
    raise ValueError(f"unknown prompt template {template!r}; expected one of {', '.join(TEMPLATES)}")
