#!/usr/bin/env bash
# Async-pipeline numbers on a machine with more than 2 CPU cores. Every compare arm gets the whole
# machine (deploy.torch_threads=0: the sync loop generates and trains on all cores, an async run
# splits them between learner and worker), so the ratio is async vs sync on the same hardware.
# Runs on CPU even where a GPU exists (CUDA hidden), so the numbers are the "CPU default" ones:
#   1. qurl compare, two arms (sync vs async η=1, both INT8 + ACR + UAQ), 60 steps each:
#      steps/hour ratio and held-out accuracy;
#   2. qurl bench sync (Qwen2.5-0.5B shapes): weight sync vs a raw gloo broadcast of the same
#      bytes; int8 vs bf16 bytes;
#   3. qurl bench stream: authenticated + validated trajectory stream GiB/s over loopback.
# About 7 minutes on 16 cores. Usage:
#   scripts/async_check.sh fetch   # HERE (with PyPI): wheels a bare Python 3.12 image lacks -> .whl/
#   scripts/async_check.sh [OUT [--set ...]]   # THERE: install .whl/*.whl if present, run, copy results to OUT
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "fetch" ]; then
  grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
  for spec in pyzmq==27.3.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
              antlr4-python3-runtime==4.13.2 megatron-core==0.16.1 blake3==1.0.11; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "$spec"
  done
  ls -l .whl
  exit 0
fi
OUT="${1:-runs/async_check}"
[ $# -gt 0 ] && shift  # the rest (e.g. --set run.steps=30) goes to qurl compare
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import zmq, blake3, math_verify, megatron.core" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1
then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/qurl-site .whl/*.whl
  export PYTHONPATH="/tmp/qurl-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export CUDA_VISIBLE_DEVICES="" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$OUT"
echo "cores: $(nproc)"
timeout 420 "$PY" -m qurl.cli compare --out "$OUT/compare" \
  --arms sync-int8-acr-uaq,async1-int8-acr-uaq "$@" 2>&1 | grep -v Warning || true
OMP_NUM_THREADS=1 timeout 300 "$PY" -m qurl.cli bench sync --shapes qwen2.5-0.5b 2>&1 | tail -6 || true
timeout 60 "$PY" -m qurl.cli bench stream 2>&1 | tail -12 || true
