"""Write (and read back) 8-bit checkpoints in the formats SGLang loads, for the rollout engines.

Before launch the engines need the policy as an 8-bit checkpoint; later syncs send the very same
codes and scales (qurl.quant.named.engine_chunks makes both), so an engine never holds bf16
linears. Three formats, with the exact parameter names and `config.json` `quantization_config`
that SGLang 0.5.23 reads (`srt/layers/quantization/w8a8_int8.py`, `w8a8_fp8.py`, `fp8.py`,
`srt/configs/model_config.py`, which takes the method from `quantization_config.quant_method`):

| fmt         | SGLang `--quantization` | tensors per decoder linear                                   | quantization_config |
| ----------- | ----------------------- | ------------------------------------------------------------ | ------------------- |
| `int8`      | `w8a8_int8`             | `weight` int8 [out, in], `weight_scale` fp32 [out, 1]        | `{"quant_method": "w8a8_int8", "is_dynamic": true, "ignore": []}` |
| `fp8`       | `w8a8_fp8`              | `weight` float8_e4m3fn [out, in], `weight_scale` fp32 [out, 1] | `{"quant_method": "w8a8_fp8"}` |
| `fp8_block` | `fp8`                   | `weight` float8_e4m3fn [out, in], `weight_scale_inv` fp32 [ceil(out/128), ceil(in/128)] | `{"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}` |

**Mixture-of-Experts (Qwen3-MoE, Mixtral).** Every expert is written under its own HF name,
`model.layers.N.mlp.experts.e.{gate,up,down}_proj.weight` (bf16: `dtype`; 8-bit: codes) with its
`weight_scale` [rows, 1] (`weight_scale_inv` [ceil(rows/128), ceil(cols/128)] for fp8_block); the
router `mlp.gate.weight` stays in `dtype`. A Mixtral's are renamed to its own checkpoint names
(qurl/models/moe.py `to_disk`): `block_sparse_moe.gate.weight`,
`block_sparse_moe.experts.e.{w1,w3,w2}.weight` (+ the same scale suffixes), which SGLang's
mixtral.py maps through `make_expert_params_mapping("w1", "w2", "w3", num_experts)` into the same
fused `w13_` / `w2_` parameters (read from the issue and the mapping's rule below, not re-checked
against mixtral.py here). Verified for Qwen3-MoE in SGLang 0.5.23's source:
- `models/qwen3_moe.py` `load_weights` maps checkpoint names through
  `FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts)`
  (`layers/moe/fused_moe_triton/layer.py`): `experts.{e}.gate_proj.` / `up_proj.` -> `experts.w13_`
  (shards "w1" / "w3"), `experts.{e}.down_proj.` -> `experts.w2_` (shard "w2"); the replacement
  keeps the suffix, so `…gate_proj.weight_scale` lands in `w13_weight_scale` and
  `…weight_scale_inv` in `w13_weight_scale_inv`.
- `FusedMoE._load_w13` writes "w1" (gate) into rows [0, I/tp) of expert e's w13 slice and "w3"
  (up) into rows [I/tp, 2I/tp) (unless a trtllm layout sets `load_up_proj_weight_first`); "w2"
  is copied whole per expert. Per-channel scales (`FusedMoeWeightScaleSupported.CHANNEL`) take the
  same path (`_load_per_channel_weight_scale`).
- `quantization/w8a8_int8.py` `W8A8Int8MoEMethod.create_weights`: `w13_weight` int8
  [E, 2I/tp, H], `w2_weight` int8 [E, H, I/tp], `w13_weight_scale` fp32 [E, 2I/tp, 1],
  `w2_weight_scale` fp32 [E, H, 1], quant_method CHANNEL; `w8a8_fp8.py` `W8A8FP8MoEMethod` the
  same with float8_e4m3fn codes. Both quantize activations per token at run time.
- `quantization/fp8.py` `Fp8MoEMethod` (block): `w13_weight_scale_inv`
  [E, 2 ceil(I/tp/128), ceil(H/128)], `w2_weight_scale_inv` [E, ceil(H/128), ceil(I/tp/128)], and
  it refuses I/tp not divisible by 128 (block_n), so fp8_block MoE checkpoints need such an I.
The engines' sync sends the same codes fused per layer (`w13_weight` ...), qurl/quant/experts.py.

All three quantize activations per token (per 1x128 group for `fp8_block`) at run time. Decoder
linears are q/k/v/o_proj and gate/up/down_proj; embeddings, lm_head and norms stay full precision,
cast to `dtype` (bf16 by default: SGLang's w8a8 kernels take bf16/fp16 activations only), and
`config.json` gets the matching `torch_dtype`. Tokenizer and generation files are copied.

UAQ: with `uaq_scale` != 1 the invariant scaling (qurl.quant.uaq) is applied to the full-precision
weights first, so the checkpoint equals what the learner (which carries the scaling in its master
weights) syncs as version 0.

Several processes (the nodes of a launch) exporting one directory at once go through
`python -m qurl.checkpoint.shared_export` instead: exported once, under a lock, while the others
wait for it complete and checksummed.

`read_8bit(dir)` reads such a checkpoint back and dequantizes every linear, for round-trip checks:
each weight is within its format's rounding error of the weight written.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from qurl.models.hf import check_checkpoint, read_state_dict, write_state_dict
from qurl.models.moe import check_moe, family, per_expert, to_disk
from qurl.quant.named import FP8_BLOCK, dequantize_named, engine_chunks, is_quantized_linear
from qurl.quant.uaq import apply_uaq

FORMATS = ("int8", "fp8", "fp8_block")
SGLANG_QUANTIZATION = {"int8": "w8a8_int8", "fp8": "w8a8_fp8", "fp8_block": "fp8"}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
         "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def quantization_config(fmt: str) -> dict:
    """The `quantization_config` block of config.json for `fmt` (see the module table)."""
    if fmt == "int8":
        return {"quant_method": "w8a8_int8", "is_dynamic": True, "ignore": []}
    if fmt == "fp8":
        return {"quant_method": "w8a8_fp8"}
    if fmt == "fp8_block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    raise ValueError(f"fmt={fmt!r}: must be one of {', '.join(FORMATS)}")


def export_8bit(src: str | Path, out: str | Path, fmt: str, *, uaq_scale: float = 1.0,
                dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int | None = 4 << 30) -> Path:
    """Write HF checkpoint `src` as an SGLang `fmt` checkpoint in `out` (written to a temp dir,
    then renamed, so a crash never leaves a half checkpoint). Returns `out`. fmt "bf16" writes a
    plain `dtype` checkpoint (no quantization_config)."""
    src, out = Path(src), Path(out)
    config = check_checkpoint(src)
    state = read_state_dict(src)
    if family(config) is not None:
        check_moe(config)
        state = per_expert(state)  # qurl's per-expert names, from the family's or fused ones
    if uaq_scale != 1.0:
        state = apply_uaq(state, uaq_scale)
    return write_checkpoint(state, config, src, out, fmt, dtype=dtype, max_shard_bytes=max_shard_bytes)


def write_checkpoint(state: dict[str, torch.Tensor], config: dict, tokenizer_dir: str | Path,
                     out: str | Path, fmt: str, *, dtype: torch.dtype = torch.bfloat16,
                     max_shard_bytes: int | None = 4 << 30) -> Path:
    """Write HF-named full-precision `state` as a `fmt` checkpoint (an 8-bit format, or "bf16":
    plain `dtype`) with `config` (config.json's fields) and the tokenizer and generation files of
    `tokenizer_dir`, into a temp dir renamed to `out`. Returns `out`."""
    if fmt not in FORMATS + ("bf16",):
        raise ValueError(f"fmt={fmt!r}: must be one of {', '.join(FORMATS + ('bf16',))}")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype={dtype}: must be bfloat16, float16 or float32")
    src, out = Path(tokenizer_dir), Path(out)
    chunks = to_disk(dict(engine_chunks(state.items(), fmt, wire_dtype=dtype, fuse=False)),
                     config)  # per expert, under the family's checkpoint names
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    total = sum(t.numel() * t.element_size() for t in chunks.values())
    write_state_dict(tmp, chunks, max_shard_bytes=max_shard_bytes if
                     (max_shard_bytes and total > max_shard_bytes) else None)
    config = dict(config)
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    config.pop("dtype", None)  # transformers 5 writes `dtype`; one key, no conflict
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        # transformers 5 keeps the RoPE base in rope_parameters only; SGLang 0.5.23 reads it there
        # (get_rope_config), but readers of the v4 layout (older SGLang / transformers 4) fall back
        # to a default base without the legacy key, silently changing RoPE
        config["rope_theta"] = rope["rope_theta"]
    if fmt == "bf16":
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization_config(fmt)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in _COPY:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def read_8bit(path: str | Path, dtype: torch.dtype = torch.float32
              ) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Read an export_8bit checkpoint: ({HF name: tensor, linears dequantized to `dtype`},
    quantization_config or None). Raises ValueError naming a code tensor without its scale."""
    path = Path(path)
    config = check_checkpoint(path)
    qcfg = config.get("quantization_config")
    state = read_state_dict(path)
    if family(config) is not None:
        state = per_expert(state)  # a Mixtral's checkpoint names -> qurl's
    block = (qcfg or {}).get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if block[0] != block[1]:
        raise ValueError(f"{path}: weight_block_size {block} must be square")
    for name, t in state.items():
        if t.dtype in (torch.int8, torch.float8_e4m3fn) and not is_quantized_linear(name):
            raise ValueError(f"{path}: {name} holds 8-bit codes but is not a decoder linear")
    try:
        out = dequantize_named(state, dtype, block=block[0])
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return out, qcfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qurl.models.export8bit",
                                description="write an HF checkpoint as an SGLang 8-bit checkpoint")
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fmt", choices=FORMATS + ("bf16",), default="int8")
    p.add_argument("--uaq-scale", type=float, default=1.0)
    args = p.parse_args(argv)
    print(export_8bit(args.src, args.out, args.fmt, uaq_scale=args.uaq_scale))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
