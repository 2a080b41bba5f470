"""Stand-in for the one vLLM symbol SGLang's generic (non-CUDA) platform imports: see _custom_ops."""
