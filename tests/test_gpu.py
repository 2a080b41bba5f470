"""GPU path on a real CUDA device (skipped without one): the local engine's bf16 / FP8 / INT8
generation, the 8-bit GEMMs against their exact CPU results, and the GPU check's CUDA-graph and
engine sections at small sizes. scripts/gpu_check.py is the full measurement (sections there)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_local_engine_fp8_int8_bf16_generate_on_gpu(tmp_path):
    from qurl.engines.local import LocalEngine
    from qurl.models.hf import build_model
    from qurl.types import GenRequest, SamplingParams

    model_dir = build_model(tmp_path / "m", "tiny", seed=0)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=0)
    for precision in ("bf16", "fp8", "int8"):
        eng = LocalEngine(model_dir, precision=precision, dtype=torch.bfloat16, device="cuda",
                          seed=0, max_batch=4, eos_token_ids=())
        res = eng.generate([GenRequest(f"r{i}", [1 + i, 2, 3], params) for i in range(4)])
        assert all(r.output_ids.numel() == 8 for r in res), precision


def test_int8_gemm_on_gpu_is_the_exact_cpu_product():
    from qurl.engines.kernels import int8_matmul

    g = torch.Generator().manual_seed(0)
    for m in (1, 17, 64):  # under 32 rows: padded on CUDA
        a = torch.randint(-127, 128, (m, 264), generator=g, dtype=torch.int8)
        w = torch.randint(-127, 128, (100, 264), generator=g, dtype=torch.int8)
        want = a.to(torch.int64) @ w.to(torch.int64).t()
        assert torch.equal(int8_matmul(a.cuda(), w.cuda()).cpu().to(torch.int64), want), m


def test_cuda_graph_over_int8_codes_rewritten_in_place_replays_exactly():
    from qurl.research.bench.gpu_check.kernel_checks import section_cuda_graph

    r = section_cuda_graph(dry=False)
    assert r["int8_code_product"]["ok"], r


def test_engine_logprobs_on_gpu_are_close_to_cpu(tmp_path):
    from qurl.research.bench.gpu_check.kernel_checks import section_engine

    r = section_engine(dry=True)  # the tiny preset, on the GPU vs on the CPU
    assert r["device"].startswith("cuda") and r["bf16"]["max_abs"] < 1e-3, r
    assert r["int8"]["max_abs"] < 0.1 and r["fp8"]["max_abs"] < 0.1, r
