"""The offline one-GPU check (issue 59): what qurl's GPU path does on a bare GPU machine.

Made for a machine with its own Python (>= 3.11) and CUDA torch, no network and no SGLang, that
receives only the tree and one folder of wheels (under 64 MiB together). Here, with network:

    python scripts/gpu_wheels.py [--python 3.12]     # megatron-core, blake3, pyzmq -> .gpu-wheels/

There (`.gpu-wheels` carried along; nothing is installed, no venv is made):

    python3 scripts/gpu_check.py --out DIR           # ~8 minutes on one H100/H200

Sections, each in its own process with a timeout (runner.py), results in DIR/results.json and
DIR/gpu_check.log; a section that cannot run prints `skipped: why`:
- env: Python, torch, CUDA, cuDNN, NCCL, Transformer Engine, qurl's dependencies and their origin;
- gemm: bf16 vs torch._int_mm vs torch._scaled_mm at Qwen2.5-1.5B/7B linear shapes, M = 1, 64,
  4096 (interleaved repeats, medians, ratios to bf16);
- cuda_graph: a graph captured over an int8 (and fp8) linear, codes then rewritten in place:
  replay vs eager, bit for bit;
- engine: the local engine's int8/fp8 log-probs on the GPU vs on the CPU;
- learner: peak memory of one row at 2k/4k/8k tokens (Qwen2.5-1.5B shapes, 2 layers, bf16) vs the
  cost model (qurl/learner/membudget.py);
- train: `qurl train` 2 steps with checkpoints, and 1 step + `--resume` to 2, compared;
- workers: `qurl train` 2 steps with deploy.rollout=workers.
`--cpu-dry-run` runs every section that can run on a CPU at tiny sizes (tests/test_gpu_check.py).
"""
from __future__ import annotations


class Skip(Exception):
    """Raised by a section that cannot run here; its message is the reason printed."""
