"""Explicit, documented patches that let megatron-core run on CPU with gloo."""
