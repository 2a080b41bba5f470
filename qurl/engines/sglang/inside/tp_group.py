"""What qurl's in-server loader (apply.py) needs of SGLang's own internals:
the only place qurl imports `sglang`, and only ever inside a running SGLang server process.

At TP size T a server runs T ranks; only rank 0 answers the HTTP call, so each rank's outcome of a
weight bucket (a delta applied or refused, a digest matched or not) is exchanged over SGLang's TP
group (its CPU group: `all_gather_object`) before the call returns.
"""
from __future__ import annotations

from typing import Any


def tp_group() -> Any:
    """SGLang's tensor-parallel group of this server process (`world_size`, `rank_in_group`,
    `all_gather_object`); SGLang 0.5.23: sglang/srt/distributed/parallel_state.py."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    return get_tp_group()
