"""A run's weight-sync settings, read once from `[deploy.sync]` (`SyncSettings.of`).

Every sync site (the synchronous loop's `WeightSync`, the async controller's fleet and its weight
group, an SGLang engine's own group) takes this record instead of reading the config table again,
so each setting is converted in one place. What each one does to a sync:

- `bucket_bytes` (deploy.sync.bucket_mb MiB, as whole bytes): the size of one wire bucket. The
  quantizer writes each version into arenas of this size (arena.py), the sender
  packs and broadcasts them one bucket at a time (buckets.py, sender.py), and the
  receivers hold buffers of it (receiver.py): larger buckets mean fewer
  collectives, more staging memory (host.py; a tensor larger than a bucket still
  travels whole in one).
- `mode`: `delta` sends only the codes, scales and pass-through values whose bits changed since
  the version the engines hold verified (whole tensors where that is smaller); `full` sends every
  tensor every time (plan.py). Both are verified by digests at every sync.
- `full_every`: with mode = delta, every this many syncs one is full anyway (0: only when the
  planner needs one: first sync, a new holder, a refusal or a mismatch).
- `verify_kernels_every`: SGLang servers only: after every full sync and every this many delta
  syncs, read back what the kernels read after SGLang's closing repack and compare it with the
  learner's digests (qurl/engines/sglang/inside/readback.py); 0 = never.
- `worker_backend`: the controller -> async workers weight group's backend: `gloo` (CPU tensors;
  SGLang workers, which forward to their servers) or `nccl` (each worker on a GPU of its own).
- `port`: the weight group's rendezvous port (generation g uses port + g - 1); 0 = a free port
  each time (broadcaster.py).

Import-light: it loads the config package only (no torch), so any room above config may hold
one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qurl.config.deployment import SyncDeployConfig

MIB = 1 << 20


@dataclass(frozen=True)
class SyncSettings:
    """The `[deploy.sync]` table as the weight path uses it (module docstring: each setting)."""
    bucket_bytes: int
    """Bytes of one wire bucket (deploy.sync.bucket_mb MiB, rounded down to a whole byte)."""
    mode: Literal["delta", "full"]
    """delta: only what changed since the version the engines hold; full: everything."""
    full_every: int
    """With mode = delta: every this many syncs one is full anyway; 0 = only when needed."""
    verify_kernels_every: int
    """SGLang: read back what the kernels read after every full and every this many delta syncs."""
    worker_backend: Literal["gloo", "nccl"]
    """Backend of the controller -> async workers weight group."""
    port: int
    """Rendezvous port of the weight group; 0 = a free port."""

    @classmethod
    def of(cls, section: SyncDeployConfig) -> SyncSettings:
        """The settings of a run's `[deploy.sync]` table (the one conversion: MiB -> bytes)."""
        return cls(bucket_bytes=int(section.bucket_mb * MIB), mode=section.mode,
                   full_every=section.full_every,
                   verify_kernels_every=section.verify_kernels_every,
                   worker_backend=section.worker_backend, port=section.port)
