"""bf16 autocast emulated with fp32 kernels (qurl/models/bf16_emulated.py), checked against the
reference it imitates: PyTorch's own CPU bf16 autocast (slow on CPUs without bf16 hardware, fine
at these sizes) and bf16 SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qurl.models.bf16_emulated import EmulatedBf16Autocast, sdpa_bf16


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_linear_matches_autocast_and_hides_steps_below_half_a_bf16_spacing():
    torch.manual_seed(0)
    x, w, b = torch.randn(32, 96), torch.randn(80, 96) * 0.05, torch.randn(80)
    with _autocast():
        ref = F.linear(x, w, b)
    with EmulatedBf16Autocast():
        emu = F.linear(x, w, b)
    assert emu.dtype == ref.dtype == torch.bfloat16
    # only the fp32 summation order differs: nearly all outputs bitwise equal, none off by more
    # than one bf16 spacing (2^-7 relative)
    assert (emu == ref).float().mean() > 0.995
    assert ((emu.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7).all()
    # a weight step of 1e-6 changes only the outputs of the weights whose bf16 value it moves;
    # the same outputs change under both, where an fp32 linear changes nearly all of them
    step = w + 1e-6
    with _autocast():
        ref_moved = (F.linear(x, step, b) != ref).float().mean()
    with EmulatedBf16Autocast():
        emu_moved = (F.linear(x, step, b) != emu).float().mean()
    fp32_moved = (F.linear(x, step, b) != F.linear(x, w, b)).float().mean()
    assert abs(emu_moved - ref_moved) < 0.01 and ref_moved < 0.5 < fp32_moved


def test_linear_gradients_are_autocasts():
    torch.manual_seed(1)
    x0, w0 = torch.randn(24, 64), torch.randn(40, 64) * 0.1
    g = torch.randn(24, 40)
    grads = []
    for ctx in (_autocast(), EmulatedBf16Autocast()):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with ctx:
            y = F.linear(x, w)
        y.backward(g.to(y.dtype))
        assert x.grad.dtype == torch.float32
        grads.append((x.grad, w.grad))
    (gx_ref, gw_ref), (gx, gw) = grads
    for got, ref in ((gx, gx_ref), (gw, gw_ref)):
        # the gradients are bf16 values in both (rounded where autocast rounds them)
        assert torch.equal(got, got.bfloat16().float())
        assert (got == ref).float().mean() > 0.99


@pytest.mark.parametrize("n", [30, 200])
def test_sdpa_matches_bf16_sdpa_closer_than_fp32(n):
    torch.manual_seed(n)
    q, k, v = (torch.randn(2, 4, n, 16) for _ in range(3))
    mask = torch.ones(2, 1, n, n, dtype=torch.bool).tril()
    mask[0, :, :, :5] = False  # left padding: the first 5 query rows of batch 0 see no key
    ref = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask)
    with EmulatedBf16Autocast():
        emu = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    fp32_once = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).bfloat16()
    assert emu.dtype == torch.bfloat16
    assert torch.equal(ref[0, :, :5], torch.zeros_like(ref[0, :, :5]))  # the kernel writes 0 there
    assert torch.equal(emu[0, :, :5], ref[0, :, :5])
    assert _rel(emu, ref) < 1.5e-3 and _rel(emu, ref) < _rel(fp32_once, ref) / 2
    causal = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    assert _rel(sdpa_bf16(q, k, v, is_causal=True), causal) < 1.5e-3


def test_sdpa_grouped_query_heads_and_bad_input():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 6, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    grouped = sdpa_bf16(q, k, v, is_causal=True, enable_gqa=True)
    repeated = sdpa_bf16(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    assert torch.equal(grouped, repeated)
    with pytest.raises(ValueError, match="dropout"):
        sdpa_bf16(q, q, q, dropout_p=0.1)


def test_llama_forward_is_closer_to_autocast_than_fp32():
    """A whole transformers Llama forward (sdpa attention, left padding): each op's last-bit
    differences flip later roundings, so the logits are not bitwise autocast's, but the emulated
    ones sit within 1% of them (a bf16 spacing is 0.4-0.8%) and much closer than fp32's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():  # weights the size of a trained model's, not init's 0.02
        p.data.mul_(5.0)
    ids = torch.randint(0, 256, (4, 24))
    mask = torch.ones_like(ids)
    mask[:2, :4] = 0

    def logits(ctx) -> torch.Tensor:
        with ctx, torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits.float()[mask.bool()]

    ref, emu = logits(_autocast()), logits(EmulatedBf16Autocast())
    fp32 = logits(torch.autocast("cpu", enabled=False))
    assert _rel(emu, ref) < 0.01 and _rel(emu, ref) < _rel(fp32, ref) / 3, (_rel(emu, ref), _rel(fp32, ref))
