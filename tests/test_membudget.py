"""The learner's micro-batch budget: the fixed logits budget on CPU, the free memory on GPU (stubbed
torch.cuda memory queries: this machine has no GPU)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import qurl.learner.megatron as lm
from qurl.learner.membudget import (GPU_FRACTION, TokenCost, fixed_bytes, free_bytes, grad_bytes,
                                    rows_per_micro)

GiB = 1 << 30
# Qwen2.5-Math-7B under learner.tp=4 (paper-dapo-7b): 152064-row vocab padded to 152064 (a
# multiple of 128 x 4), 28 layers, hidden 3584, 28 heads of 128, 4 KV heads, FFN 18944, bf16, flash
# attention (SDPA or Transformer Engine).
DAPO = TokenCost(152064 // 4, layers=28, hidden=3584, heads=28, groups=4, head_dim=128, ffn=18944,
                 tp=4, elem=2)


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


def test_token_cost_hand_worked():
    # h 8, d 4, q 8, kv 4, f 16, 2 layers, fp32, TP 1. One layer per token:
    # (4h + 4d + 5q + 5f) x 4 = (32 + 16 + 40 + 80) x 4 = 672, + 4 x heads = 8 -> 680 (flash);
    # the final norm 2h x 4 = 64 -> 2 x 680 + 64 = 1424 bytes per token, whatever L.
    c = TokenCost(1000, layers=2, hidden=8, heads=2, groups=1, head_dim=4, ffn=16, tp=1, elem=4)
    assert c.token_bytes(10) == c.token_bytes(10_000) == 1424
    # unfused: + heads x L x 4 (fp32 probs) per token and layer instead of the 8 of the lse
    u = replace(c, attention="unfused")
    assert u.token_bytes(100) == 2 * (672 + 2 * 100 * 4) + 64
    # full recompute keeps h x 4 per layer: 2 x 32 + 64 = 128; selective keeps
    # (5h + 4d) x 4 + (4q + 3kv) x 4 = 224 + 176 = 400 per layer -> 864
    assert replace(c, recompute="full").token_bytes(10) == 128
    assert replace(c, recompute="selective").token_bytes(10) == 864
    # a micro-batch of 3 rows x 10: kept 30 x 1424, one chunk of 30 x 1000 logits at 4 + 12 bytes
    assert c.micro_bytes(3, 10) == 30 * 1424 + 30_000 * 16
    # the chunk is capped: 2**26 logits whatever the length
    assert c.micro_bytes(1, 10**6) == 10**6 * 1424 + 2**26 * 16
    # full recompute: one layer rebuilt on top of what is kept
    assert replace(c, recompute="full").micro_bytes(3, 10) == 30 * (128 + 680) + 30_000 * 16
    # the forward: one chunk's product and fp32 copy (8 bytes per logit)
    assert c.forward_bytes(3, 10) == 30 * 1424 + 30_000 * 8
    # under full recompute, one MLP's forward intermediates (5f x 4 = 320 per token) or the
    # chunk, whichever is larger: 30 x 320 < 240000 here, and with 1 vocab row the MLP wins
    f = replace(c, recompute="full")
    assert f.forward_bytes(3, 10) == 30 * 128 + 30_000 * 8
    assert replace(f, local_vocab=1).forward_bytes(3, 10) == 30 * 128 + 30 * 320


def test_flash_attention_memory_is_linear_in_the_length():
    for L in (4096, 8192, 16384):
        assert DAPO.token_bytes(L) == DAPO.token_bytes(1024)
    unfused = replace(DAPO, attention="unfused")
    assert unfused.micro_bytes(1, 8192) > 1.9 * unfused.micro_bytes(1, 4096)


def test_gpu_budget_is_the_free_memory_share_over_the_micro_batch_cost(gpu_with):
    dev = gpu_with(60 * GiB, reserved=6 * GiB, allocated=2 * GiB)
    free = free_bytes(dev)
    assert free == 64 * GiB  # the driver's free + the allocator's reserved-but-unused
    rows = rows_per_micro(2048, DAPO, free, 2**26)
    # the most rows whose micro-batch fits GPU_FRACTION of the free memory
    assert DAPO.micro_bytes(rows, 2048) <= GPU_FRACTION * free < DAPO.micro_bytes(rows + 1, 2048)
    assert rows > 1  # the fixed CPU budget would give one 2048-token row per pass
    assert rows_per_micro(2048, DAPO, None, 2**26) == 1
    assert rows_per_micro(20480, DAPO, gpu_free := free_bytes(gpu_with(1 * GiB)), 0) == 1
    assert gpu_free == GiB


def test_gradient_and_fixed_bytes():
    # 10 params in bf16: 10 x 2 gradient bytes, + a tied head of 6 elements summed in later
    assert grad_bytes(10, 2, tied_head=6) == 32
    # weights + grads (2 + 2) + masters 4 + moments 8 (/ DP 4 when sharded) + flat grad 4
    assert fixed_bytes(10, 2, dp=4, distributed=False) == 10 * 20
    assert fixed_bytes(10, 2, dp=4, distributed=True) == 10 * 14


def test_the_learner_splits_by_the_gpu_memory_it_measures(gpu_with, monkeypatch):
    """MegatronLearner._micro_batches measures the free memory once per split and cuts the
    longest-first rows by it (the learner itself is not built: that needs a GPU)."""
    monkeypatch.setattr(lm, "LOGITS_BUDGET", 1)  # the CPU budget would give one row each
    fake = SimpleNamespace(device=gpu_with(DAPO.micro_bytes(2, 2048) / GPU_FRACTION + 1),
                           _token_cost=DAPO)
    fake._rows_per_micro = lambda L, free: lm.MegatronLearner._rows_per_micro(fake, L, free)
    ends = torch.tensor([100, 2048, 2000, 300, 1024])
    starts = torch.tensor([50, 7, 9, 60, 30])
    got = [(idx.tolist(), w, s) for idx, w, s in
           lm.MegatronLearner._micro_batches(fake, torch.arange(5), ends, starts)]
    # 2 rows at width 2048; at width 1024 the same bytes hold 4: the other three in one pass
    # (one process: the agreed minimum over ranks is this rank's own reading);
    # each micro-batch's head starts at its rows' earliest first loss column
    assert got == [([1, 2], 2048, 7), ([4, 3, 0], 1024, 30)]
    fake.device = torch.device("cpu")
    assert len(list(lm.MegatronLearner._micro_batches(fake, torch.arange(5), ends))) == 5
