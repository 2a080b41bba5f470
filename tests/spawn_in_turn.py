"""Several spawned runs of learner ranks (`qurl.learner.dist.spawn`) in one set of processes, in
turn: each process starts torch and megatron once instead of once per run. A fixture that ran
`spawn(fn, n, *args)` for a few (fn, n, args) runs `spawn_in_turn([(key, n, fn, args), ...])`."""
from __future__ import annotations

from pathlib import Path


def in_turn(rank: int, world: int, jobs: list[tuple], ports: list[int], meet: str) -> dict:
    """Each job (key, n, fn, args) in turn as `fn(rank, n, *args)` in the first n of `world`
    processes (the others sit it out): one set of processes starting torch and megatron once,
    not once per job. Each job joins a process group of its own at its own port and leaves it
    (destroy_learner_dist); its ranks meet (files in `meet`) first, so none reaches the group's
    store long before rank 0 opens it. Returns {key: fn's result} of the jobs this rank ran."""
    import os
    import time
    from pathlib import Path

    from qurl.learner.dist import destroy_learner_dist

    out = {}
    for i, ((key, n, fn, args), port) in enumerate(zip(jobs, ports, strict=True)):
        if rank >= n:
            continue
        (Path(meet) / f"{i}.{rank}").touch()
        while not all((Path(meet) / f"{i}.{r}").exists() for r in range(n)):
            time.sleep(0.02)
        os.environ["MASTER_PORT"] = str(port)
        out[key] = fn(rank, n, *args)
        destroy_learner_dist()
    return out


def spawn_in_turn(jobs: list[tuple], meet: Path) -> dict:
    """`in_turn` in max(n) spawned processes; {key: [result of each of its n ranks]}."""
    from qurl.learner.dist import free_port, spawn

    ports: list[int] = []
    while len(ports) < len(jobs):
        if (port := free_port()) not in ports:
            ports.append(port)
    ranks = spawn(in_turn, max(n for _, n, _, _ in jobs), jobs, ports, str(meet))
    return {key: [ranks[r][key] for r in range(n)] for key, n, _, _ in jobs}
