"""Test-wide settings: offline Hugging Face (no hub here), GPU tests skipped without CUDA, the
`one_thread` fixture for modules of tiny in-process models, and `runs_dir`: run directories that
share one cache of warm-started base models for the whole session."""
import os
from pathlib import Path

import pytest
import torch

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
    shared = tmp_path_factory.mktemp("base-cache")

    def make(name: str) -> Path:
        root = tmp_path_factory.mktemp(name)
        (root / "_base").symlink_to(shared, target_is_directory=True)
        return root

    return make
