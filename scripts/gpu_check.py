#!/usr/bin/env python3
"""The offline one-GPU check: run it on the GPU machine with that machine's own Python and torch.

    python3 scripts/gpu_check.py --out DIR [--wheels .gpu-wheels] [--sections env,gemm,...]
    python3 scripts/gpu_check.py --out DIR --cpu-dry-run      # rehearsal on a CPU, tiny sizes

Nothing is installed and no network is used: the packages qurl needs that the image lacks come as
wheels in one folder prepared beforehand on a machine with network (`python scripts/gpu_wheels.py
--python 3.12`, carried along with the tree). Results: DIR/results.json and DIR/gpu_check.log.
Sections and sizes: qurl/research/bench/gpu_check/__init__.py. This file must parse on old Pythons too, so
that it can say which Python it needs.
"""
import os
import sys

if sys.version_info < (3, 11):
    sys.stderr.write("gpu_check: qurl needs Python >= 3.11, this is %s (%s)\n"
                     % (sys.version.split()[0], sys.executable))
    sys.exit(2)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qurl.research.bench.gpu_check.runner import main  # noqa: E402  (after the version check)

if __name__ == "__main__":
    sys.exit(main())
