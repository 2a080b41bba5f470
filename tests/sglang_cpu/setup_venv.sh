#!/usr/bin/env bash
# Build .venv-sglang: the real sglang==0.5.23 on this CPU, without CUDA packages, for `make test-sglang`.
# torch 2.13.0 (CPU) first; sglang with --no-deps; its non-CUDA requirements with torch pinned; then the
# CPU fixes SGLang's generic path needs here (see tests/sglang_cpu/README.md):
#   1. torchvision from PyPI is a CUDA build: empty its fake-op registrations and drop its _C.so;
#   2. `vllm._custom_ops.rotary_embedding` is provided by tests/sglang_cpu/vllm (put on PYTHONPATH by the tests);
#   3. torchcodec (a CUDA build) must not be installed: sglang falls back to decord.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=$(cd "$here/../.." && pwd)/${1:-.venv-sglang}
py=${PY:-python3.11}
test -x "$venv/bin/python" || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps sglang==0.5.23
"${pip[@]}" -r "$here/requirements.txt" torch==2.13.0
"$venv/bin/python" -m pip uninstall -q -y torchcodec torchaudio 2>/dev/null || true
tv=$("$venv/bin/python" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("torchvision")
print(os.path.dirname(spec.origin) if spec else "")
PY
)
if [ -n "$tv" ]; then
  : > "$tv/_meta_registrations.py"
  rm -f "$tv"/_C*.so
fi
"$venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
PYTHONPATH="$here" "$venv/bin/python" -c "import sglang.srt.entrypoints.http_server" 
touch "$venv/.installed"
echo "sglang venv ready: $venv"
