"""A run's directory and its checkpoints: everything that is written to disk to resume a run.

rundir.py     runs/<name>/: the resolved config, the checkpoint directories (written to a temp dir
              and renamed: atomic), which one is the newest intact, resume checks
checksums.py  the manifest: size and BLAKE3 checksum of every checkpoint file, checked on load
shards.py     one learner rank's Megatron shard of model and optimizer state, with its checksums
"""
