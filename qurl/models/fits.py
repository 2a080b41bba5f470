"""Does a checkpoint fit the layout a run asks for? Checked before any rank or server starts.

A user's model is not shaped for every layout, and the places that would notice fail late and
far away: megatron-core asserts inside every learner rank, SGLang's scheduler dies in its own log.
`qurl train` runs these checks where the base is resolved (qurl/commands/train.py), so the error is
one line naming the sizes, exit 2.

- **Architecture**: dense Qwen2, Qwen3 and Llama, and Qwen3-MoE and Mixtral (qurl/models/convert.py
  `check_supported`, qurl/models/moe.py `check_moe`); anything else (another family, MoE options
  other than theirs, sliding windows, scaled RoPE, a missing weight shard or tokenizer) is
  refused here rather than inside the learner ranks. A MoE run also needs the learner at
  TP 1 and the local engine with a precision its experts take, or SGLang in the one case a real
  server ran end to end: an untied Qwen3-MoE at bf16, sglang.tp 1, no routing replay
  (`check_moe_run`).
- **Expert parallelism** (`learner.ep`): it divides a mixture of experts' E experts over ep
  data-parallel ranks, so ep must divide E, and a dense model takes only ep = 1
  (`check_learner_ep`; that ep divides learner.dp is a config rule, qurl/config/rules.py).
- **Tensor parallelism** (`learner.tp`): Megatron splits attention heads, KV heads (GQA query
  groups) and the SwiGLU width across ranks, so tp must divide all three. SmolLM2-135M has 9
  heads over 3 KV heads: tp 1 and 3 fit, tp 2 does not.
- **Block FP8 on SGLang** (`rollout.precision=fp8_block`, SGLang 0.5.23
  `srt/layers/quantization/fp8_utils.py` `validate_fp8_block_shape`): SGLang fuses q|k|v and
  gate|up into one GEMM and requires every fused part but the last to be a whole number of
  128-row weight blocks; with `sglang.tp` > 1 every per-rank part, and every row-parallel input
  slice (o_proj, down_proj), too. SmolLM2-135M's q_proj has 576 rows (4.5 blocks), so its
  fused qkv cannot be block-quantized; int8 and per-channel fp8 have no such rule.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from qurl.errors import InputError

FP8_BLOCK = 128  # SGLang's weight_block_size [128, 128] (qurl.models.export8bit writes it)


def read_fields(base: str) -> dict[str, Any]:
    """config.json of checkpoint dir `base`, or a local preset's fields (tiny, small)."""
    from qurl.models.hf import MODEL_PRESETS

    if base in MODEL_PRESETS:  # the vocabulary is the character tokenizer's (not a preset field)
        from qurl.models.hf import preset_architecture
        from qurl.models.tokenizer import build_tokenizer

        return dict(MODEL_PRESETS[base], vocab_size=len(build_tokenizer()),
                    architectures=[preset_architecture(base)])  # what qurl.models.hf builds
    try:
        return json.loads((Path(base) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"model.base={base!r}: cannot read config.json ({e})") from None


def check_learner_tp(fields: dict[str, Any], tp: int, base: str) -> None:
    """InputError (one line, naming the head counts) unless tp divides heads, KV heads, FFN."""
    from qurl.models.convert import _check_tp

    try:
        _check_tp(SimpleNamespace(**fields), tp)
    except (ValueError, AttributeError, TypeError) as e:
        raise InputError(f"{e} (model.base={base})") from None


def fp8_block_problem(fields: dict[str, Any], sglang_tp: int = 1) -> str | None:
    """Why SGLang 0.5.23 cannot load this model as block FP8 at `sglang_tp`, or None if it can."""
    from qurl.models.convert import dims

    d = dims(SimpleNamespace(**fields))
    q, kv, ffn = d["nh"] * d["hd"], d["ng"] * d["hd"], d["I"]
    merged = {"q_proj|k_proj|v_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
              "gate_proj|up_proj": [("gate_proj", ffn), ("up_proj", ffn)]}
    for fused, parts in merged.items():
        checked = parts if sglang_tp > 1 else parts[:-1]  # the last part may end mid-block
        for name, rows in checked:
            if (rows // sglang_tp) % FP8_BLOCK:
                return (f"{name} has {rows // sglang_tp} output rows per rank, not a multiple of "
                        f"the {FP8_BLOCK}-row blocks SGLang needs in its fused {fused} GEMM")
    if sglang_tp > 1:
        for name, cols in (("o_proj", q), ("down_proj", ffn)):
            if (cols // sglang_tp) % FP8_BLOCK:
                return (f"{name} has {cols // sglang_tp} input columns per rank, not a multiple "
                        f"of the {FP8_BLOCK}-column blocks SGLang needs")
    return None


def check_architecture(fields: dict[str, Any], base: str) -> None:
    """InputError (one line) unless qurl's conversion takes this architecture: dense Qwen2, Qwen3
    or Llama, or Qwen3-MoE or Mixtral, with SwiGLU, RMSNorm gains, plain RoPE and full attention in every
    layer."""
    from qurl.models.convert import check_supported

    try:
        check_supported(SimpleNamespace(**fields))
    except (ValueError, AttributeError, TypeError) as e:
        raise InputError(f"model.base={base}: {e}; qurl trains dense Qwen2, Qwen3 and Llama "
                         f"checkpoints and Qwen3-MoE and Mixtral ones (SwiGLU MLP, RMSNorm, plain RoPE, full "
                         f"attention)") from None


def check_learner_ep(fields: dict[str, Any], ep: int, base: str) -> None:
    """InputError (one line) unless learner.ep = `ep` fits the model: 1 for a dense model, a
    divisor of the expert count for a mixture of experts."""
    if ep == 1:
        return
    from qurl.models.convert import is_moe
    from qurl.models.moe import num_experts

    cfg = SimpleNamespace(**fields)
    if not is_moe(cfg):
        raise InputError(f"learner.ep={ep}: model.base={base} is a dense model (expert parallelism "
                         f"divides a mixture of experts' experts over the ranks); set learner.ep=1")
    E = num_experts(cfg)
    if E % ep:
        raise InputError(f"learner.ep={ep}: must divide the {E} experts of model.base={base}")


def sglang_moe_problems(fields: dict[str, Any] | None, *, precision: str, sglang_tp: int,
                        routing_replay: str) -> list[str]:
    """What keeps a MoE run off SGLang (empty: it runs there): the one case a real SGLang 0.5.23
    server ran end to end (docs/moe.md "Real SGLang", tests/test_sglang_real_moe.py) is an untied
    Qwen3-MoE at bf16 on sglang.tp=1, with or without routing replay (the engine then asks the
    server for its routes: qurl/engines/sglang/protocol.py "Routes"). 8-bit MoE servers load
    and take qurl's verified expert sync, but their forward (Triton's fused MoE) has not run
    here; the in-server expert loader writes TP 1 layouts only; SGLang's Qwen3MoeForCausalLM
    never ties lm_head to embed_tokens (models/qwen3_moe.py:1017), so a tied checkpoint serves
    uniform logits; Mixtral has not been run. `routing_replay` no longer limits anything (kept for
    the callers). fields None: the shape is unknown."""
    out = []
    arch = (fields or {}).get("model_type") or "".join((fields or {}).get("architectures") or [])
    if fields is None:
        out.append("a model whose config is unknown here")
    elif "qwen3_moe" not in arch and "Qwen3Moe" not in arch:
        out.append("a model other than Qwen3-MoE")
    if precision != "bf16":
        out.append(f"rollout.precision={precision} (8-bit MoE servers have not generated here)")
    if sglang_tp != 1:
        out.append(f"sglang.tp={sglang_tp} (qurl's expert loader writes TP 1 layouts only)")
    if fields is not None and fields.get("tie_word_embeddings"):
        out.append("a tied lm_head (SGLang's Qwen3-MoE never ties it: uniform logits)")
    return out


def check_moe_run(base: str, *, learner_tp: int, engine: str, precision: str,
                  sglang_tp: int = 1, routing_replay: str = "off",
                  fields: dict[str, Any] | None = None) -> None:
    """What a MoE (Qwen3-MoE, Mixtral) run needs beyond the checkpoint (InputError, one line
    naming every part that is missing, joined by '; '): the learner at TP 1 (megatron-core 0.16's MoE layer trains at
    TP > 1 only with sequence parallelism, which qurl's learner does not use; evaluation would
    run), a precision the local engine's experts take (bf16, int8, fp8:
    qurl/engines/moe_block.py), and on SGLang the one case a real server ran
    (`sglang_moe_problems`; `fields`: the model's config fields, None when unknown). `qurl train`
    (check_fits) and `qurl launch` (its model check) both ask here."""
    missing = []
    if learner_tp > 1:
        missing.append(f"learner.tp={learner_tp} (megatron-core trains a MoE layer at TP > 1 only "
                       "with sequence parallelism, which qurl's learner does not use; set "
                       "learner.tp=1)")
    if engine == "sglang":
        problems = sglang_moe_problems(fields, precision=precision, sglang_tp=sglang_tp,
                                       routing_replay=routing_replay)
        if problems:
            missing.append("rollout.engine=sglang (qurl runs a MoE inside SGLang only as an "
                           "untied Qwen3-MoE at bf16, sglang.tp=1; here: "
                           f"{', '.join(problems)}; or use rollout.engine=local)")
    elif engine != "local":
        missing.append(f"rollout.engine={engine} (use rollout.engine=local)")
    if engine == "local" and precision not in ("bf16", "int8", "fp8"):
        missing.append(f"rollout.precision={precision} (the local engine's experts take bf16, "
                       "int8 or fp8)")
    if missing:
        raise InputError(f"model.base={base} is a mixture of experts, and qurl cannot yet run one "
                         f"with {'; with '.join(missing)}")


def check_fits(base: str, *, learner_tp: int, engine: str, precision: str, sglang_tp: int,
               routing_replay: str = "off", learner_ep: int = 1) -> None:
    """Every check above for checkpoint `base` (a path or a local preset), and that it is a
    complete checkpoint of a supported architecture (and, with algo.routing_replay on, a
    mixture-of-experts one); InputError, one line."""
    from qurl.models.hf import MODEL_PRESETS, check_checkpoint

    fields = read_fields(base)
    check_architecture(fields, base)
    from qurl.models.convert import is_moe

    moe = is_moe(SimpleNamespace(**fields))
    if routing_replay != "off" and not moe:
        raise InputError(f"algo.routing_replay={routing_replay}: model.base={base} is a dense model "
                         f"(no experts to replay); set algo.routing_replay=off")
    check_learner_ep(fields, learner_ep, base)
    if moe:
        check_moe_run(base, learner_tp=learner_tp, engine=engine, precision=precision,
                      sglang_tp=sglang_tp, routing_replay=routing_replay, fields=fields)
    check_learner_tp(fields, learner_tp, base)
    if engine == "sglang" and precision == "fp8_block":
        problem = fp8_block_problem(fields, sglang_tp)
        if problem:
            raise InputError(f"rollout.precision=fp8_block with rollout.engine=sglang: {problem} "
                             f"(model.base={base}); use rollout.precision=fp8 (per channel) or int8")
    if base not in MODEL_PRESETS:
        check_checkpoint(base)  # weights and tokenizer files present
