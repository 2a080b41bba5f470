"""Test-wide settings: offline Hugging Face (no hub here), GPU tests skipped without CUDA, and the
`one_thread` fixture for modules of tiny in-process models."""
import os

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
