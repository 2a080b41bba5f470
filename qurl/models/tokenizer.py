"""A character-level tokenizer for the locally built models (no hub download).

Every printable ASCII character (0x20-0x7E) and the newline is one token; four special tokens follow:

    <|unk|>         any other character (so non-ASCII text never crashes encoding)
    <|endoftext|>   end of sequence; also the padding token (Qwen2 convention)
    <|im_start|>    chat turn start
    <|im_end|>      chat turn end

100 tokens in all, so the vocabulary splits evenly over tensor-parallel ranks 1, 2 and 4. The
tokenizer is built with the `tokenizers` library (a WordLevel model over single characters: the
pre-tokenizer isolates each character, the Fuse decoder joins tokens back without separators) and
wrapped as a transformers `PreTrainedTokenizerFast`, so it saves and reloads through `AutoTokenizer`
like any hub tokenizer. A Qwen-style chat template (`<|im_start|>role\\ncontent<|im_end|>\\n`) makes
`apply_chat_template` work.

Invariants: `decode(encode(s)) == s` for every string of printable ASCII and newlines; token ids are
stable (chars first in code-point order, then specials), so checkpoints built at different times agree.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

UNK = "<|unk|>"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIALS: tuple[str, ...] = (UNK, EOS, IM_START, IM_END)
CHARS: tuple[str, ...] = tuple(chr(c) for c in range(0x20, 0x7F)) + ("\n",)

# Qwen2-style template without Qwen's default system prompt (the tiny model never saw one).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """The character tokenizer: 96 characters + 4 specials = 100 ids; eos = pad = `<|endoftext|>`."""
    vocab = {ch: i for i, ch in enumerate(CHARS)}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Each character (newline included: [\s\S], not '.') becomes its own pre-token.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    # Registered as special so they are matched as whole strings before the per-char split.
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNK,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return tok
