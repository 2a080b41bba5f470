#!/usr/bin/env bash
# GPU check of qurl on ONE GPU (sized for an H200, < 10 minutes): Megatron learner on GPU (logits
# parity vs transformers, train steps, tokens/s) and the local engine's FP8 (torch._scaled_mm) /
# INT8 vs bf16 generation tokens/s on a ~1B random Qwen2, and (where sglang is installed) real SGLang
# servers in int8 / fp8 / fp8 block with real weight updates: engine-vs-learner mismatch per precision.
# Prints a table (see qurl/bench/gpu_check.py).
#   scripts/gpu_check.sh [--skip-learner] [--skip-engine] [--skip-sglang]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec timeout --signal=INT 570 "$PY" -m qurl.bench.gpu_check "$@"
