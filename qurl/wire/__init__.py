"""How weights travel from the learner to the engines: the pieces both ends share.

A low room: it knows tensors, bytes and process groups, never an engine or the learner.
delta.py        delta encoding of a new version against the last (changed positions + values)
digest.py       BLAKE3 digests of tensors and of a whole version, which the receivers recompute
buckets.py      packing named tensors into fixed-size byte buckets and back
group.py        the weight-update process group (learner rank 0 + every engine rank)
sender.py       sending buckets over that group, with per-bucket replies and timing
broadcaster.py  the sender plus the group's lifecycle, as the learner side holds it

Kept import-light: SGLang's server process imports delta.py and digest.py (through
qurl/engines/sglang/inside/), and that environment has no megatron or transformers.
"""
