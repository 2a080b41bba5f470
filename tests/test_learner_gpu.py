"""The same learner checks as test_learner.py on CUDA with NCCL (skipped without a GPU).

Deterministic kernels are switched on so that exact resume can be asserted bit for bit on GPU too
(embedding backward uses atomics otherwise).
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _deterministic_worker(rank: int, ws: int) -> dict:
    from test_learner import _worker

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    return _worker(rank, ws)


@pytest.mark.parametrize("ws", [1, 2])
def test_learner_on_gpu(ws: int) -> None:
    from qurl.learner.dist import spawn

    if torch.cuda.device_count() < ws:
        pytest.skip(f"needs {ws} GPUs")
    res = spawn(_deterministic_worker, ws)[0]
    for kind in ("qwen2", "llama"):
        assert res[kind]["logits_diff"] <= 1e-4, kind  # GPU megatron vs CPU transformers, fp32
        assert res[kind]["logp_t07_diff"] <= 1e-4, kind
        assert res[kind]["weights_exact"], kind
        assert res[kind]["stats"]["skipped_updates"] == 0
    assert res["uaq_weights_exact"] and res["uaq_logits_diff"] <= 1e-4
    assert res["resume_stats_equal"] and res["resume_weights_equal"] and res["resume_moved"]
    assert res["patches_again"] == {"current_device": False, "rng_tracker": False}
    if ws == 1:
        assert res["from_dir_exact"] and res["bf16_master_dtypes"] == {"torch.float32"}
        assert res["bf16_logp_diff"] < 0.15 and res["kl_ref_frozen"]
