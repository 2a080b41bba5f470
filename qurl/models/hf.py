"""Hugging Face checkpoints on disk: build the local presets, check, load, read and write them.

qurl never downloads from a model hub. The CPU default is a tiny Qwen2-architecture model built here
from a preset (random init + the character tokenizer of `qurl.models.tokenizer`), saved with
`save_pretrained` (safetensors) and reloaded through the Auto classes with `HF_HUB_OFFLINE=1`. Any
other Qwen2, Qwen3, Qwen3-MoE, Llama or Mixtral checkpoint directory on disk loads the same way.

A loadable checkpoint directory holds:
- `config.json` whose `architectures` names Qwen2ForCausalLM, Qwen3ForCausalLM,
  Qwen3MoeForCausalLM, LlamaForCausalLM or MixtralForCausalLM and whose `model_type` is qwen2,
  qwen3, qwen3_moe, llama or mixtral;
- weights as `model.safetensors`, or `model.safetensors.index.json` plus every shard it lists;
- a tokenizer: `tokenizer.json`, or `tokenizer.model` (SentencePiece), or `vocab.json` + `merges.txt`.
`check_checkpoint` verifies exactly this and raises InputError (one line, exit 2 at the command
line) naming the missing file or the unsupported field together with the directory.

Presets (parameter counts include the tied embedding once):
- `tiny`  hidden 256, 4 layers, 8 heads / 2 KV heads (GQA), SwiGLU 896, tied embeddings: ~3.4M;
- `small` hidden 768, 12 layers, 12 heads / 4 KV heads, SwiGLU 3072, tied embeddings: ~104M;
- `tiny-qwen3` as `tiny` but Qwen3 (transformers' Qwen3Config): q/k norms, no q/k/v bias, and a
  head size that is not hidden / heads (8 heads of 64 over hidden 256, as Qwen3-0.6B has 16 of
  128 over 1,024): ~3.7M.
- `tiny-qwen3-moe` as `tiny-qwen3` but Qwen3-MoE (transformers' Qwen3MoeConfig): every layer's MLP
  is 8 routed SwiGLU experts of width 224, top-2 with the top-2 weights renormalised
  (`norm_topk_prob`, Qwen3-30B-A3B's routing), no shared expert: 6.85M in all, 2.72M active
  per token. (Its `intermediate_size` 896 is the width of a dense MLP layer, which it has none of.)
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "LlamaForCausalLM", "MixtralForCausalLM")
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "llama", "mixtral")
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

_COMMON: dict[str, Any] = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    initializer_range=0.02,
    attention_dropout=0.0,
    use_cache=True,
)
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        _COMMON, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=896, max_position_embeddings=512,
    ),
    "small": dict(
        _COMMON, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, intermediate_size=3072, max_position_embeddings=2048,
    ),
    "tiny-qwen3": dict(
        _COMMON, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, intermediate_size=896, max_position_embeddings=512,
    ),
    "tiny-qwen3-moe": dict(
        _COMMON, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, intermediate_size=896, moe_intermediate_size=224,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
    ),
}
_ARCHITECTURE = {"tiny-qwen3": "Qwen3ForCausalLM", "tiny-qwen3-moe": "Qwen3MoeForCausalLM"}


def preset_architecture(preset: str) -> str:
    """The HF architecture a local preset builds."""
    return _ARCHITECTURE.get(preset, "Qwen2ForCausalLM")


def _offline() -> None:
    """Forbid hub access for everything transformers does from here on (we only read local dirs),
    and silence its per-file progress bars (loading a local checkpoint is instant)."""
    from transformers.utils import logging as hf_logging

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    hf_logging.disable_progress_bar()


def build_model(
    out_dir: str | Path, preset: str, *, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Build a randomly initialised Qwen2 (Qwen3 for `tiny-qwen3`, Qwen3-MoE for `tiny-qwen3-moe`)
    model from `preset` (+ config `overrides`) with the character tokenizer and save both to
    `out_dir` (safetensors; experts under their per-expert names). Deterministic given `seed`.
    Returns `out_dir`."""
    from transformers import (GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    from qurl.models.tokenizer import build_tokenizer

    if preset not in MODEL_PRESETS:
        raise ValueError(f"model preset must be one of {tuple(MODEL_PRESETS)}, got {preset!r}")
    tok = build_tokenizer()
    fields = dict(MODEL_PRESETS[preset], **(overrides or {}))
    tok.model_max_length = int(fields["max_position_embeddings"])
    arch = preset_architecture(preset)
    config_cls, model_cls = {"Qwen3ForCausalLM": (Qwen3Config, Qwen3ForCausalLM),
                             "Qwen3MoeForCausalLM": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}.get(
        arch, (Qwen2Config, Qwen2ForCausalLM))
    config = config_cls(
        vocab_size=len(tok),
        bos_token_id=tok.eos_token_id,  # Qwen2 convention: no separate BOS
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **fields,
    )
    config.architectures = [arch]
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config)
    finally:
        torch.random.set_rng_state(state)  # do not disturb the caller's RNG stream
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=False
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _offline()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _fail(path: Path, what: str) -> ValueError:
    from qurl.errors import InputError

    return InputError(f"checkpoint {path}: {what}")


def check_checkpoint(path: str | Path) -> dict[str, Any]:
    """Validate an HF checkpoint directory (see module docstring); return its parsed config.json.

    Raises ValueError naming the missing file or unsupported field, and the directory."""
    p = Path(path)
    if not p.is_dir():
        raise _fail(p, "not a directory")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise _fail(p, "missing config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise _fail(p, f"config.json is not valid JSON (line {err.lineno}): {err.msg}") from err
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise _fail(
            p, f"config.json field 'architectures' = {archs!r} is not supported "
            f"(expected one of {SUPPORTED_ARCHITECTURES})"
        )
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise _fail(
            p, f"config.json field 'model_type' = {cfg.get('model_type')!r} is not supported "
            f"(expected one of {SUPPORTED_MODEL_TYPES})"
        )
    for shard in _weight_files(p):
        if not shard.is_file():
            raise _fail(p, f"missing weight shard {shard.name} (listed in {WEIGHTS_INDEX})")
    has_tok = (p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file() or (
        (p / "vocab.json").is_file() and (p / "merges.txt").is_file()
    )
    if not has_tok:
        raise _fail(p, "missing tokenizer.json (or tokenizer.model, or vocab.json + merges.txt)")
    return cfg


def _weight_files(p: Path) -> list[Path]:
    """The safetensors files holding the weights of checkpoint `p`, in index order."""
    if (p / WEIGHTS_FILE).is_file():
        return [p / WEIGHTS_FILE]
    index = p / WEIGHTS_INDEX
    if not index.is_file():
        raise _fail(p, f"missing {WEIGHTS_FILE} (or {WEIGHTS_INDEX})")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise _fail(p, f"{WEIGHTS_INDEX} has no valid 'weight_map'") from err
    return [p / name for name in dict.fromkeys(weight_map.values())]


def load_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) from an HF Qwen2/Llama checkpoint directory, offline, in eval mode.

    The model is an `AutoModelForCausalLM` instance with parameters in `dtype`."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    check_checkpoint(p)
    _offline()
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True)
    model.eval()
    return model, load_tokenizer(p)


def load_tokenizer(path: str | Path):
    """The tokenizer of an HF checkpoint directory, offline, as `load_checkpoint` returns it (a
    pad token set to EOS when it has none: Llama tokenizers often do not; padding is masked)."""
    from transformers import AutoTokenizer

    _offline()
    tok = AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded index) under their HF names.

    Tied checkpoints hold only `model.embed_tokens.weight` (no `lm_head.weight`), as saved."""
    p = Path(path)
    out: dict[str, torch.Tensor] = {}
    for shard in _weight_files(p):
        if not shard.is_file():
            raise _fail(p, f"missing weight shard {shard.name} (listed in {WEIGHTS_INDEX})")
        out.update(load_file(str(shard)))
    return out


def write_state_dict(
    path: str | Path, state_dict: dict[str, torch.Tensor], *, max_shard_bytes: int | None = None
) -> list[Path]:
    """Write `state_dict` as safetensors into directory `path` (created if needed).

    One `model.safetensors`, or with `max_shard_bytes` shards `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json`, the layout `read_state_dict` and `from_pretrained` read. Tensors are
    written contiguous and unshared (safetensors refuses aliased storage). Returns the files written."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1 and max_shard_bytes is None:
        save_file(shards[0], str(p / WEIGHTS_FILE), metadata=meta)
        return [p / WEIGHTS_FILE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(p / name), metadata=meta)
        files.append(p / name)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (p / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))
    files.append(p / WEIGHTS_INDEX)
    return files


def param_count(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(t.numel() for t in model.parameters())


def vocab_size(path: str | Path) -> int:
    """Token ids the checkpoint's model accepts, [0, vocab_size), from its config (as the engines
    read it: LocalEngine from the loaded model, SGLang's adapter from AutoConfig)."""
    from transformers import AutoConfig

    _offline()
    return int(AutoConfig.from_pretrained(Path(path), local_files_only=True).vocab_size)
