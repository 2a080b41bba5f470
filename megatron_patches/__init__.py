"""Explicit, documented patches that let megatron-core run on CPU with gloo.

`megatron_patches.cpu.apply_cpu_patches()` is called by the learner only when no CUDA device exists;
importing this package patches nothing. Each patch (what, why, versions, delete-when) is documented
in megatron_patches/cpu.py.
"""
