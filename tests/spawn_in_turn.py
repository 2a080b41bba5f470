"""Several spawned runs of learner ranks (`qurl.learner.dist.spawn`) in one set of processes, in
turn: each process starts torch and megatron once instead of once per run. A fixture that ran
`spawn(fn, n, *args)` for a few (fn, n, args) runs `spawn_in_turn([(key, n, fn, args), ...])`."""
from __future__ import annotations

from pathlib import Path


def meet(where: str | Path, name: str, rank: int, n: int) -> int:
    """Ranks 0..n-1 meet (files in `where`) and agree on a free port that rank 0 picks then, just
    before they join a process group there: none reaches the group's store long before rank 0
    opens it, and the port is fresh (not picked minutes earlier)."""
    import os
    import time

    from qurl.learner.dist import free_port

    where = Path(where)
    (where / f"{name}.{rank}").touch()
    while not all((where / f"{name}.{r}").exists() for r in range(n)):
        time.sleep(0.02)
    port = where / f"{name}.port"
    if rank == 0:
        tmp = where / f"{name}.port.tmp"
        tmp.write_text(str(free_port()))
        os.replace(tmp, port)
    while not port.exists():
        time.sleep(0.02)
    return int(port.read_text())


def in_turn(rank: int, world: int, jobs: list[tuple], where: str) -> dict:
    """Each job (key, n, fn, args) in turn as `fn(rank, n, *args)` in the first n of `world`
    processes (the others sit it out): one set of processes starting torch and megatron once,
    not once per job. Each job joins a process group of its own at a port of its own (`meet`)
    and leaves it (destroy_learner_dist). Returns {key: fn's result} of the jobs this rank ran."""
    import os

    from qurl.learner.dist import destroy_learner_dist

    out = {}
    for i, (key, n, fn, args) in enumerate(jobs):
        if rank >= n:
            continue
        os.environ["MASTER_PORT"] = str(meet(where, str(i), rank, n))
        out[key] = fn(rank, n, *args)
        destroy_learner_dist()
    return out


def spawn_in_turn(jobs: list[tuple], where: Path) -> dict:
    """`in_turn` in max(n) spawned processes (`where`: an empty folder for `meet`);
    {key: [result of each of its n ranks]}."""
    from qurl.learner.dist import spawn

    ranks = spawn(in_turn, max(n for _, n, _, _ in jobs), jobs, str(where))
    return {key: [ranks[r][key] for r in range(n)] for key, n, _, _ in jobs}
