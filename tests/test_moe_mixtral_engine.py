"""A Mixtral checkpoint in the local engine (fp32 / int8 / fp8 experts, its routes), in the 8-bit
export under Mixtral's own checkpoint names, and in `qurl train`'s one-line refusals.

The checkpoint is tests/tiny_hf.py's Mixtral (hidden 64, 2 layers, 8 experts of width 32, top-2,
Llama attention, wide seeded weights) saved by transformers with the character tokenizer.
"""
from __future__ import annotations

import pytest
import torch
from tiny_hf import build_mixtral

from qurl.engines.local import LocalEngine
from qurl.models.hf import load_checkpoint, read_state_dict
from qurl.types import GenRequest, SamplingParams

LOGITS_TOL = 1e-4  # fp32 engine vs transformers' forward: the same ops
# KL(full || 8-bit) per token, mean over sampled tokens, as tests/test_moe_engine.py bounds it;
# measured here int8 1.7e-3, fp8 5.6e-3
KL_BOUND = {"int8": 5e-3, "fp8": 0.1}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from qurl.models.tokenizer import build_tokenizer

    d = tmp_path_factory.mktemp("mixtral") / "m"
    tok = build_tokenizer()
    model = build_mixtral(seed=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          bos_token_id=tok.eos_token_id)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def hf(model_dir):
    model = load_checkpoint(model_dir, dtype=torch.float32)[0].eval()
    model.config._experts_implementation = "eager"
    return model


@pytest.fixture(scope="module")
def engines(model_dir):
    cache: dict[str, LocalEngine] = {}

    def get(precision: str) -> LocalEngine:
        if precision not in cache:
            cache[precision] = LocalEngine(model_dir, precision=precision, seed=0)
        return cache[precision]
    return get


def _reqs(max_new: int = 6) -> list[GenRequest]:
    return [GenRequest(rid=str(i), prompt_ids=p,
                       params=SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=i))
            for i, p in enumerate(PROMPTS)]


def test_full_precision_logits_and_routes_equal_transformers(engines, hf):
    eng = engines("bf16")
    k = hf.config.num_experts_per_tok
    for r in eng.generate(_reqs()):
        ids = r.prompt_ids + r.output_ids.tolist()
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=True)
        got = eng.token_logits(r.prompt_ids, r.output_ids.tolist())
        p = len(r.prompt_ids)
        assert (got - out.logits[0, p - 1: p - 1 + len(r.output_ids)]).abs().max().item() < LOGITS_TOL
        want = torch.stack([torch.softmax(x.float(), -1).topk(k, -1).indices
                            for x in out.router_logits], dim=1).sort(-1).values[:-1]
        assert tuple(r.routed_experts.shape) == (len(ids) - 1, 2, k)
        assert torch.equal(r.routed_experts.long().sort(-1).values, want)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_experts_close_to_full_precision(engines, fmt):
    full, q = engines("bf16"), engines(fmt)
    assert q._tensors["model.layers.1.mlp.experts.w13_weight"].dtype == {
        "int8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt]
    assert q._tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # router: full
    kls = []
    for r in full.generate(_reqs()):
        a = full.token_logits(r.prompt_ids, r.output_ids.tolist()).double().log_softmax(-1)
        b = q.token_logits(r.prompt_ids, r.output_ids.tolist()).double().log_softmax(-1)
        kls.append((a.exp() * (a - b)).sum(-1))
    assert 0 < torch.cat(kls).mean().item() < KL_BOUND[fmt]  # > 0: the experts really are 8-bit


def test_8bit_export_uses_mixtral_names_and_reads_back(model_dir, hf, tmp_path):
    from qurl.models.export8bit import export_8bit, read_8bit

    out = export_8bit(model_dir, tmp_path / "int8", "int8", dtype=torch.float32)
    raw = read_state_dict(out)
    assert raw["model.layers.0.block_sparse_moe.experts.5.w1.weight"].dtype == torch.int8
    assert tuple(raw["model.layers.0.block_sparse_moe.experts.5.w2.weight_scale"].shape) == (64, 1)
    assert raw["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32
    assert not any(".mlp." in k for k in raw)
    back, qcfg = read_8bit(out)
    assert qcfg["quant_method"] == "w8a8_int8"
    gu = hf.model.layers[0].mlp.experts.gate_up_proj[5].detach()  # [2I, H]: gate rows, up rows
    for name, w in (("gate_proj", gu[:32]), ("up_proj", gu[32:])):
        got = back[f"model.layers.0.mlp.experts.5.{name}.weight"]
        step = w.abs().amax(1, keepdim=True) / 127  # per output row
        assert bool(((got - w).abs() <= step / 2 + 1e-7).all())


def test_plain_export_loads_in_transformers(model_dir, hf, tmp_path):
    from qurl.models.export8bit import export_8bit

    out = export_8bit(model_dir, tmp_path / "plain", "bf16", dtype=torch.float32)
    again = load_checkpoint(out, dtype=torch.float32)[0]
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), again.state_dict().values()))


def test_a_mixtral_run_at_tp2_is_refused_in_one_line(model_dir, tmp_path, capsys):
    from qurl.cli import main

    rc = main(["train", "--set", f"model.base={model_dir}", "--set", "learner.tp=2",
               "--set", f"deploy.dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "sequence parallelism" in err[0], err
    assert not (tmp_path / "runs").exists()
