"""The weight sync's copies of the 8-bit model live in host memory (issue 59 item 5): the two
arenas (qurl/weights/arena.py) and the SGLang adapter's kept copy (qurl/engines/sglang/
verified_sync.py), pinned when CUDA is available; `qurl.weights.host.sync_memory` reports where
each holder's bytes are (the GPU check's hook). On this CPU-only host "before" and "after" both
read "cpu"; on a GPU host the same report shows the arenas in "cpu_pinned" and only the sender's
staging buffers under "cuda"."""
from __future__ import annotations

import torch

from qurl.engines.sglang.verified_sync import apply_to_kept
from qurl.quant.named import quantize_named
from qurl.weights.publish import WeightSync
from qurl.weights.host import HoldsSyncMemory, place, sync_memory, to_host

HOST = "cpu_pinned" if torch.cuda.is_available() else "cpu"


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(2):
        out.append((f"model.layers.{i}.self_attn.q_proj.weight", torch.randn(32, 48, generator=g)))
        out.append((f"model.layers.{i}.mlp.down_proj.weight", torch.randn(48, 64, generator=g)))
        out.append((f"model.layers.{i}.input_layernorm.weight", torch.randn(48, generator=g)))
    out.append(("model.embed_tokens.weight", torch.randn(50, 48, generator=g)))
    return out


def test_arenas_are_host_memory_and_chunks_stay_bit_exact():
    sync = WeightSync("int8", bucket_bytes=4096, wire_dtype=torch.bfloat16)
    assert isinstance(sync, HoldsSyncMemory)
    for v in range(3):  # versions 0, 1: new arenas; 2: written into arena 0
        named = _named(v)
        chunks, _ = sync.quantize(iter(named))
        want = [(n, t.to(torch.bfloat16) if not n.endswith("_scale") and t.is_floating_point()
                 else t) for n, t in quantize_named(named, "int8")]
        assert [n for n, _ in chunks] == [n for n, _ in want]
        for (n, got), (_, ref) in zip(chunks, want):
            assert place(got) == HOST, n
            assert got.dtype == ref.dtype and torch.equal(got.view(torch.uint8),
                                                          ref.contiguous().view(torch.uint8)), n
    report = sync_memory(sync)
    assert set(report["arenas"]) == {HOST} and report["total"].get("cuda", 0) == 0
    one = sum(t.numel() * t.element_size() for _, t in chunks)
    assert report["arenas"][HOST] == 2 * one  # two arenas, each one version's chunks


def test_kept_copy_is_host_memory():
    kept = {"w": to_host(torch.arange(6, dtype=torch.int8))}
    apply_to_kept(kept, [("w", torch.full((6,), 3, dtype=torch.int8))])  # a whole tensor
    assert place(kept["w"]) == HOST and kept["w"].tolist() == [3] * 6
    if torch.cuda.is_available():  # a device chunk is copied out, not kept on the GPU
        apply_to_kept(kept, [("w", torch.ones(6, dtype=torch.int8, device="cuda"))])
        assert place(kept["w"]) == "cpu_pinned"


def test_sync_memory_counts_each_storage_once():
    class Holder:
        def __init__(self, ts):
            self.ts = ts

        def sync_tensors(self):
            return {"a": self.ts}

    base = torch.zeros(100, dtype=torch.uint8)
    report = sync_memory(Holder([base[:10], base[10:]]), Holder([base]), None)
    assert report["a"] == {"cpu": 100} and report["total"] == {"cpu": 100}
