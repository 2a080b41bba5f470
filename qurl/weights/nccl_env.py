"""One NCCL environment for every process of a weight group, and the check that they agree.

Why. NCCL reads its settings from each process's environment, and peers of one communicator that
disagree on how buffers are allocated or which transports exist can hang rather than fail.
SGLang 0.5.23 changes two of them in its server process when they are unset
(`sglang/srt/entrypoints/engine.py`, `_set_envs_and_config`, lines 1898-1915:
`NCCL_CUMEM_ENABLE` = int(enable_symm_mem or the KV-shard gather), i.e. "0" by default, and
`NCCL_NVLS_ENABLE` = int(enable_nccl_nvls or enable_symm_mem), "0" by default), while a learner
or worker left alone keeps NCCL's own defaults (cuMem on since NCCL 2.19): one weight group then
mixes the two (issue 59, item 2).

What qurl does:
- `QURL_NCCL` are the values qurl gives every process it plans or spawns (`qurl launch`
  commands, SGLang servers, rollout workers, the learner's ranks): SGLang's defaults, so a server
  started by someone else with SGLang's defaults matches too. A value already set in the
  environment is kept (`with_nccl_defaults`), and children inherit it: set it once, for the
  whole job, to change it.
- `settings(environ)` are the values of `MUST_AGREE` one process reports ("unset" for a missing
  one); interface names (NCCL_SOCKET_IFNAME) differ per node by nature and are not compared.
- `disagreement(...)` names the first setting two members differ on, both sides in one line;
  group.py exchanges the reports over the group's store at every formation (gloo and
  NCCL alike) and refuses the group on a disagreement.
"""
from __future__ import annotations

import json
import os
import socket
from typing import Any, Iterable, Mapping

QURL_NCCL: dict[str, str] = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
MUST_AGREE: tuple[str, ...] = (
    "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_MNNVL_ENABLE", "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_NET", "NCCL_PROTO", "NCCL_ALGO")
UNSET = "unset"


def with_nccl_defaults(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` (default os.environ) with QURL_NCCL for every variable it does not set."""
    env = dict(os.environ if environ is None else environ)
    for k, v in QURL_NCCL.items():
        env.setdefault(k, v)
    return env


def apply_nccl_defaults() -> None:
    """Give this process QURL_NCCL where unset; call before its first NCCL communicator."""
    for k, v in QURL_NCCL.items():
        os.environ.setdefault(k, v)


def settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{name: value or "unset"} of MUST_AGREE in `environ` (default os.environ)."""
    env = os.environ if environ is None else environ
    return {k: env.get(k, UNSET) for k in MUST_AGREE}


def disagreement(a_name: str, a: Mapping[str, str], b_name: str, b: Mapping[str, str]
                 ) -> str | None:
    """None if the two reports agree, else one line naming the setting and both sides."""
    for k in MUST_AGREE:
        if a.get(k, UNSET) != b.get(k, UNSET):
            return (f"NCCL settings differ inside one weight group: {k}={a.get(k, UNSET)} on "
                    f"{a_name}, {k}={b.get(k, UNSET)} on {b_name}; give every process the same "
                    f"value (qurl sets {', '.join(f'{n}={v}' for n, v in QURL_NCCL.items())} "
                    "where unset)")
    return None


class NcclMismatch(ValueError):
    """Members of one weight group run with different NCCL settings (one line, both sides)."""


def report(rank: int) -> dict[str, Any]:
    """What a member says about itself: rank, host, pid and its NCCL `settings()`."""
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "nccl": settings()}


def member(r: Mapping[str, Any]) -> str:
    return f"rank {r['rank']} ({r['host']} pid {r['pid']})"


def agree_over_store(store: Any, rank: int, reporters: Iterable[int]) -> None:
    """The check at group formation, over the group's torch.distributed store (a gloo or NCCL
    group alike). A peer (rank != 0) writes its `report` under str(rank) and waits for rank 0's
    "verdict"; rank 0 reads the report of every rank in `reporters`, compares it with its own and
    posts the verdict ("" = agreed). Both sides raise NcclMismatch with the same one line."""
    mine = report(rank)
    if rank != 0:
        store.set(str(rank), json.dumps(mine))
        verdict = store.get("verdict").decode()
    else:
        verdict = ""
        for r in sorted(set(reporters)):
            theirs = json.loads(store.get(str(r)).decode())
            verdict = disagreement(member(mine), mine["nccl"], member(theirs),
                                   theirs["nccl"]) or ""
            if verdict:
                break
        store.set("verdict", verdict)
    if verdict:
        raise NcclMismatch(verdict)


def check_known(known: Mapping[str, Mapping[str, str]]) -> None:
    """Rank 0 before inviting peers that cannot report (SGLang servers): {peer name: the settings
    it was launched with}; NcclMismatch on the first that differs from this process."""
    mine = report(0)
    for name, theirs in known.items():
        line = disagreement(member(mine), mine["nccl"], name, theirs)
        if line:
            raise NcclMismatch(line)
