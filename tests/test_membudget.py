"""The learner's micro-batch budget: the fixed logits budget on CPU, the free memory on GPU (stubbed
torch.cuda memory queries: this machine has no GPU)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import qurl.learner.megatron as lm
from qurl.learner.membudget import GPU_FRACTION, TokenCost, free_bytes, rows_per_micro

GiB = 1 << 30
# Qwen2.5-Math-7B under learner.tp=4 (paper-dapo-7b): 152064-row vocab padded to 152064 (a
# multiple of 128 x 4), 28 layers, hidden 3584, 28 heads, bf16, Transformer Engine attention.
DAPO = TokenCost(152064 // 4, layers=28, hidden=3584, heads=28, tp=4, elem=2, fused_attention=True)


@pytest.fixture
def gpu_with(monkeypatch):
    """torch.cuda's memory queries answering as a GPU with `free` driver bytes and `reserved` /
    `allocated` bytes in torch's caching allocator."""
    def stub(free: int, reserved: int = 0, allocated: int = 0) -> torch.device:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free, 141 * GiB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: allocated)
        return torch.device("cuda", 0)
    return stub


def test_cpu_keeps_the_fixed_logits_budget():
    assert free_bytes(torch.device("cpu")) is None
    # 2**26 fp32 logits / (440 tokens x 38016 local vocab rows) = 4.01 -> 4 rows
    assert rows_per_micro(440, DAPO, None, 2**26) == 4
    assert rows_per_micro(8192, DAPO, None, 2**26) == 1  # never 0


def test_gpu_budget_is_the_free_memory_share_over_the_token_cost(gpu_with):
    dev = gpu_with(60 * GiB, reserved=6 * GiB, allocated=2 * GiB)
    free = free_bytes(dev)
    assert free == 64 * GiB  # the driver's free + the allocator's reserved-but-unused
    # per token: logits 38016 x (2 + 12) = 532224 B; activations 28 x 3584 x (10 + 24/4) x 2/2
    # = 1605632 B; together 2137856 B. 0.8 x 64 GiB / (2048 x 2137856 B) = 12.56 -> 12 rows
    assert DAPO.bytes(2048) == 532224 + 1605632
    assert GPU_FRACTION == 0.8 and rows_per_micro(2048, DAPO, free, 2**26) == 12
    # the fixed CPU budget would give one 2048-token row per pass
    assert rows_per_micro(2048, DAPO, None, 2**26) == 1
    # unfused attention (local layer spec) keeps [heads, L, L] scores: + 28 x 5 x 28 x 2048 / 4
    # x 2/2 = 2007040 B per token -> 0.8 x 64 GiB / (2048 x 4144896 B) = 6.47 -> 6 rows
    local = TokenCost(38016, layers=28, hidden=3584, heads=28, tp=4, elem=2, fused_attention=False)
    assert local.bytes(2048) == 2137856 + 2007040 and rows_per_micro(2048, local, free, 0) == 6
    assert rows_per_micro(20480, DAPO, gpu_free := free_bytes(gpu_with(1 * GiB)), 0) == 1
    assert gpu_free == GiB


def test_the_learner_splits_by_the_gpu_memory_it_measures(gpu_with, monkeypatch):
    """MegatronLearner._micro_batches measures the free memory once per split and cuts the
    longest-first rows by it (the learner itself is not built: that needs a GPU)."""
    monkeypatch.setattr(lm, "LOGITS_BUDGET", 1)  # the CPU budget would give one row each
    fake = SimpleNamespace(device=gpu_with(2 * 2048 * DAPO.bytes(2048) / GPU_FRACTION + 1),
                           _token_cost=DAPO)
    fake._rows_per_micro = lambda L, free: lm.MegatronLearner._rows_per_micro(fake, L, free)
    ends = torch.tensor([100, 2048, 2000, 300, 1024])
    starts = torch.tensor([50, 7, 9, 60, 30])
    got = [(idx.tolist(), w, s) for idx, w, s in
           lm.MegatronLearner._micro_batches(fake, torch.arange(5), ends, starts)]
    # 2 rows at width 2048; at width 1024 the same bytes hold 4: the other three in one pass;
    # each micro-batch's head starts at its rows' earliest first loss column
    assert got == [([1, 2], 2048, 7), ([4, 3, 0], 1024, 30)]
    fake.device = torch.device("cpu")
    assert len(list(lm.MegatronLearner._micro_batches(fake, torch.arange(5), ends))) == 5
