"""The weight path: how the learner's weights become the bytes each rollout engine holds.

A step's weights go down this room in one direction, and every file here owns one stage:

publish.py      `WeightSync`: UAQ-scaled masters -> 8-bit chunks -> delta or full -> each engine,
                then verification of what each engine holds
arena.py        the quantizer's reusable output buffers (quantized in place)
plan.py         delta vs full per engine, from what each last verified
resync.py       after each load: accept, resend in full (refused / mismatch), or halt the run (a
                second mismatch in a row); the one rule for the in-process engine and each worker
delta.py        delta encoding of a new version against the last (changed positions + values)
digest.py       BLAKE3 digests of tensors and of a whole version, which the receivers recompute
buckets.py      packing named tensors into fixed-size byte buckets and back
group.py        the weight-update process group (learner rank 0 + every engine rank)
sender.py       sending buckets over that group, with per-bucket replies and timing
broadcaster.py  the sender plus the group's lifecycle, as the learner side holds it
host.py         where the 8-bit copies live between syncs: host memory (pinned with CUDA)
nccl_env.py     the NCCL environment a weight group needs across nodes
receiver.py     the engine side in an async worker: receive buckets, install, verify
settings.py     `SyncSettings`: the run's `[deploy.sync]` table, read once (bucket bytes, delta or
                full, periodic full syncs, kernel read-backs, the workers' backend, the port)

The transport files (delta, digest, buckets, group, sender, broadcaster, host, nccl_env) know
tensors, bytes and process groups, never an engine or the learner. They stay import-light: the
SGLang server process imports delta.py and digest.py (through qurl/engines/sglang/inside/), and
that environment has no megatron or transformers, so this __init__ imports nothing.
"""
