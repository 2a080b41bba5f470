"""A server that does not run qurl's sync loader (here: tests/fake_sglang.py, which does not
implement it and does not list it in /server_info) keeps getting full syncs, with the reason
`unsupported`, and its records say `sync/verified` = NaN (not checked): never a delta it cannot
apply, never a verification it did not do. The real loader: tests/test_sglang_real_delta.py."""
from __future__ import annotations

import math

import pytest
import torch

from qurl.engines.sglang.engine import SGLangEngine
from qurl.engines.sglang.launcher import ServerSpec
from qurl.weights.publish import WeightSync
from qurl.weights.group import free_port
from tests.test_sglang_engine import FAST, _fake_cmd


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    named = [(f"model.layers.{i}.{kind}.weight", torch.randn(*shape, generator=g))
             for i in range(2) for kind, shape in (("self_attn.q_proj", (32, 48)),
                                                    ("mlp.down_proj", (48, 64)))]
    return named + [("model.norm.weight", torch.randn(48, generator=g))]


def test_server_without_the_sync_loader_gets_full_unverified_syncs(tmp_path):
    port = free_port()
    eng = SGLangEngine([ServerSpec(f"http://127.0.0.1:{port}", command=_fake_cmd(tmp_path, port))],
                       precision="int8", bucket_bytes=4096, timeouts=FAST,
                       log_dir=tmp_path / "logs")
    try:
        assert not eng.delta_capable and not eng.can_verify and eng.digest is None
        sync = WeightSync("int8", bucket_bytes=4096, wire_dtype=torch.bfloat16)
        recs = [sync.push(iter(_weights(k)), eng, version=k) for k in (1, 2, 3)]
        with pytest.raises(ValueError, match="cannot apply deltas"):
            eng.load_weights(iter([]), 4, base=(3, "00"))
    finally:
        eng.close()
    for r in recs:
        assert r["sync/delta"] == 0.0 and r["sync/full_reason/unsupported"] == 1.0
        assert math.isnan(r["sync/verified"]) and r["sync/bytes"] == r["sync/full_bytes"]
    assert recs[-1]["sync/fallbacks/unsupported"] == 3.0
    assert eng.version == 3
