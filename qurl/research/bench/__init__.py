"""Benchmarks behind `qurl bench`: the local engine's generation speed per precision (engines.py),
the ZeroMQ trajectory stream (stream.py) and the weight broadcast (sync.py).

They print ratios measured side by side in one run; they live here, outside the packages that
run training, so the production code holds only what a run executes.
"""
