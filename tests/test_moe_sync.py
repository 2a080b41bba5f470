"""Issue 67 item 3: MoE expert codes and scales through the weight sync, verified per expert.

- `engine_chunks` fuses a layer's per-expert weights into SGLang's `w13_weight` [E, 2I, H] /
  `w2_weight` [E, H, I] and quantizes them per expert and row (`_scale` [E, rows, 1]; fp8_block:
  `_scale_inv` per expert tile); the router passes through; dequantizing gives the fused weights
  back within the format's rounding;
- `WeightSync` loads them into the local MoE engine in full, then as a delta, each verified;
- two corruptions no layer-level check sees (every name, shape, dtype and byte count stays):
  (a) gate and up rows swapped inside one expert's w13 codes, (b) one expert's w2 scales wrong.
  The per-expert digests name exactly that layer and expert, and the existing resync path (resend
  in full, qurl/weights/resync.py) repairs it: the sync ends verified and counts one resync.
"""
from __future__ import annotations

import pytest
import torch

from qurl.engines.local import LocalEngine
from qurl.models import moe
from qurl.models.hf import build_model, load_checkpoint
from qurl.quant.experts import fuse_experts, split_experts
from qurl.quant.named import dequantize_named, engine_chunks
from qurl.weights.publish import WeightSync

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
E, I, H = 8, 32, 64
W13 = "model.layers.1.mlp.experts.w13_weight"
W2 = "model.layers.0.mlp.experts.w2_weight"


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("moesync") / "m", "tiny-qwen3-moe", overrides=TINY)


@pytest.fixture(scope="module")
def named(model_dir) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint as the learner's named_weights gives it: per-expert names, fp32, untied."""
    model = load_checkpoint(model_dir, dtype=torch.float32)[0]
    sd = moe.per_expert({k: v.detach().clone() for k, v in model.state_dict().items()})
    sd.pop("lm_head.weight", None)
    return list(sd.items())


def _step(named, seed: int) -> list[tuple[str, torch.Tensor]]:
    """One 'training step': a small change to every weight (some codes flip)."""
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 2e-3 * t.abs().mean() * torch.randn(t.shape, generator=g)) for n, t in named]


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_block", "bf16"])
def test_engine_chunks_fuse_and_quantize_experts_per_expert(named, fmt):
    chunks = dict(engine_chunks(named, fmt))
    assert not any(".experts.0." in n for n in chunks)  # no per-expert names left
    assert "model.layers.0.mlp.gate.weight" in chunks  # the router: full precision
    assert chunks["model.layers.0.mlp.gate.weight"].is_floating_point()
    fused = dict(fuse_experts(named))
    assert tuple(fused[W13].shape) == (E, 2 * I, H) and tuple(fused[W2].shape) == (E, H, I)
    assert torch.equal(fused[W13][3, I:], dict(named)["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert dict(split_experts(fused.items())).keys() == dict(named).keys()
    if fmt == "bf16":
        assert chunks[W13].dtype == torch.bfloat16
        return
    scale = {"fp8_block": "_scale_inv"}.get(fmt, "_scale")
    want = {"int8": (E, 2 * I, 1), "fp8": (E, 2 * I, 1), "fp8_block": (E, 2, 1)}[fmt]
    assert tuple(chunks[W13 + scale].shape) == want  # fp8_block: gate and up tiled apart
    back = dequantize_named(chunks)
    tol = {"int8": 1 / 127, "fp8": 2 ** -4, "fp8_block": 2 ** -4}[fmt]
    for name in (W13, W2):
        err = (back[name] - fused[name]).abs().amax(dim=-1)
        assert bool((err <= tol * fused[name].abs().amax(dim=-1) + 1e-6).all())


def test_expert_codes_equal_per_expert_quantization(named):
    from qurl.quant.formats import quantize_per_channel

    chunks = dict(engine_chunks(named, "int8"))
    codes, scale = quantize_per_channel(dict(named)["model.layers.0.mlp.experts.5.down_proj.weight"],
                                        "int8")
    assert torch.equal(chunks[W2][5], codes) and torch.equal(chunks[W2 + "_scale"][5], scale)


class Corrupting(LocalEngine):
    """A local engine whose next load is followed once by `fault` (a broken loader's repack)."""

    fault = None

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen: list[list[str]] = []

    def load_weights(self, chunks, version, **kw) -> None:
        super().load_weights(chunks, version, **kw)
        if self.fault is not None:
            fault, self.fault = self.fault, None
            with torch.no_grad():
                fault(self)

    def verify(self, digests):
        bad = super().verify(digests)
        self.seen.append(bad)
        return bad


def _swap_gate_up(eng: LocalEngine) -> None:  # (a) inside expert 3 of layer 1
    w = eng._tensors[W13]
    gate = w[3, :I].clone()
    w[3, :I] = w[3, I:]
    w[3, I:] = gate


def _wrong_scales(eng: LocalEngine) -> None:  # (b) expert 6 of layer 0
    eng._tensors[W2 + "_scale"][6] *= 1.25


def _layer_check(eng: LocalEngine, chunks) -> bool:
    """What a check over whole tensors' names, shapes, dtypes and sizes sees."""
    return all(tuple(eng._tensors[n].shape) == tuple(t.shape) and eng._tensors[n].dtype == t.dtype
               and eng._tensors[n].numel() * eng._tensors[n].element_size()
               == t.numel() * t.element_size() for n, t in chunks)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_full_and_delta_sync_verified_per_expert_and_corruptions_resynced(model_dir, named, fmt):
    eng = Corrupting(model_dir, precision=fmt)
    sync = WeightSync(fmt, mode="delta")
    v0 = sync.push(iter(named), eng, 1)
    assert v0["sync/verified"] == 1.0 and v0["sync/delta"] == 0.0
    v1_named = _step(named, 1)
    v1 = sync.push(iter(v1_named), eng, 2)
    assert v1["sync/verified"] == 1.0 and v1["sync/delta"] == 1.0  # expert codes as a delta
    want = dict(engine_chunks(v1_named, fmt))
    for n in (W13, W13 + "_scale", W2, W2 + "_scale"):
        assert torch.equal(eng._tensors[n].view(torch.uint8), want[n].view(torch.uint8))

    for step, (fault, key) in enumerate([(_swap_gate_up, f"{W13}@expert3"),
                                         (_wrong_scales, f"{W2}_scale@expert6")], start=3):
        eng.fault, eng.seen = fault, []
        v_named = _step(named, step)
        chunks = list(engine_chunks(v_named, fmt))
        stats = sync.push(iter(v_named), eng, step)
        assert _layer_check(eng, chunks)  # a layer-level check would have passed
        assert eng.seen == [[key], []]  # per expert: exactly that layer and expert, then clean
        # the record says the first check failed on one slice and one full resend followed
        assert stats["sync/resync/mismatch"] == 1.0 and stats["sync/verify_mismatches"] == 1.0
        assert eng.digest is not None and eng.version == step  # the resent version verified
        for n, t in chunks:  # after the full resend the engine holds the sender's bits
            assert torch.equal(eng._tensors[n].view(torch.uint8), t.view(torch.uint8)), n


def test_full_precision_experts_sync_per_expert_and_adopt(model_dir, named):
    """A bf16 (here fp32) engine takes fused full-precision experts, in full and as a delta, each
    verified per expert; a receiver's whole-model chunks are adopted (no copy) and decode."""
    eng = Corrupting(model_dir, precision="bf16")
    sync = WeightSync("bf16", mode="delta")
    assert sync.push(iter(named), eng, 1)["sync/verified"] == 1.0
    stats = sync.push(iter(_step(named, 1)), eng, 2)
    assert stats["sync/verified"] == 1.0 and stats["sync/delta"] == 1.0
    keys = [k for k in sync.planner.plan(list(engine_chunks(named, "none")), 3, None).digests
            if k.startswith(W13)]
    assert keys == [f"{W13}@expert{e}" for e in range(E)]

    q = LocalEngine(model_dir, precision="int8")
    chunks = [(n, t.clone()) for n, t in engine_chunks(_step(named, 5), "int8")]
    held = dict(q._tensors)
    q.load_weights(iter(chunks), 7, adopt=True)
    assert q.adopted and q._tensors[W13].data_ptr() == dict(chunks)[W13].data_ptr()
    assert held.keys() == q._tensors.keys()
    from qurl.types import GenRequest, SamplingParams

    r = q.generate([GenRequest(rid="a", prompt_ids=[5, 6, 7],
                               params=SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))])[0]
    assert tuple(r.routed_experts.shape) == (3 + len(r.output_ids) - 1, 2, 2)
    assert r.versions.tolist() == [7] * len(r.output_ids)
