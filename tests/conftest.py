"""Test-wide settings: offline Hugging Face (no hub here), GPU tests skipped without CUDA, the
`one_thread` fixture for modules of tiny in-process models, `runs_dir`: run directories that
share one cache of warm-started base models for the whole session, and the CPU share of each
pytest-xdist worker (`make test` runs the suite on two)."""
import os
from pathlib import Path


def _pin_xdist_worker() -> int:
    """Give each xdist worker its own slice of this machine's cores, before torch starts its thread
    pool. qurl divides a process's cores among the processes computing at once
    (qurl/node/placement.py) but cannot see the other worker; two workers each spinning OpenMP
    threads on every core would run many times slower than one. Pinned, each worker's in-process
    runs and the subprocesses it starts (they inherit the affinity) see only their slice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not worker or n < 2 or not hasattr(os, "sched_setaffinity"):
        return 0
    cores = sorted(os.sched_getaffinity(0))
    i = int(worker.removeprefix("gw"))
    mine = cores[i::n] or [cores[i % len(cores)]]
    os.sched_setaffinity(0, mine)
    return len(mine)


_WORKER_CORES = _pin_xdist_worker()

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKER_CORES:
    torch.set_num_threads(_WORKER_CORES)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls gain nothing from a second thread, and on a shared, oversubscribed 2-core
    machine OpenMP barriers make 2 threads 10x+ slower; restore the setting afterwards."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory):
    """`runs_dir(name)` makes a fresh directory to use as deploy.dir whose `_base/` is one cache shared
    by the whole session: qurl/models/base.py keys each warm-started base model by everything that
    determines it, so every module (and every `qurl` subprocess) asking for the same one builds
    it once, not once per module."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one cache for all workers too: the builds lock
        base = base.parent  # the run's directory, above each worker's own
    shared = base / "base-cache"
    shared.mkdir(exist_ok=True)

    def make(name: str) -> Path:
        root = tmp_path_factory.mktemp(name)
        (root / "_base").symlink_to(shared, target_is_directory=True)
        return root

    return make
