#!/usr/bin/env python3
"""Prepare the GPU check's wheel folder here (needs PyPI): megatron-core, blake3 and pyzmq as wheels
for the GPU image's Python, in .gpu-wheels/ (git-ignored; carried to the GPU machine).

    python scripts/gpu_wheels.py [--python 3.12|3.11] [--dest DIR]

What is brought and why: qurl/research/bench/gpu_check/wheels.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qurl.research.bench.gpu_check.wheels import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
