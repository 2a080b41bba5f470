"""GPU path on a real CUDA device (skipped without one): Megatron learner parity and train step on
the GPU, local engine bf16 / FP8 / INT8 generation. Small sizes; scripts/gpu_check.sh is the full
measurement."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_learner_on_gpu_matches_transformers_and_trains(tmp_path):
    from qurl.bench.gpu_check import check_learner

    r = check_learner(tmp_path, preset="tiny", batch=4, seq=32, steps=1)
    assert r["parity_rel"] < 1e-3 and r["train_finite"] == 1.0 and r["train_tok_s"] > 0


def test_local_engine_fp8_int8_bf16_on_gpu(tmp_path):
    from qurl.bench.gpu_check import check_engine

    r = check_engine(tmp_path, overrides={"num_hidden_layers": 2}, batch=4, prompt=8,
                     new_tokens=8)
    assert all(r[f"{p}_tok_s"] > 0 for p in ("bf16", "fp8", "int8"))
