"""The local rollout engine against transformers, and its 8-bit modes against its bf16 mode.

The model is the tiny preset (Qwen2), and the tiny Qwen3 one, cut to 2 layers, with a wider init (std 0.1) so next-token
distributions are peaked like a trained model's rather than near-uniform (which would make greedy
ties likely and every KL trivially small). Everything runs in fp32 on CPU.
"""
from __future__ import annotations

import pytest
import torch

from qurl.engines.local import LocalEngine
from qurl.models.hf import build_model, load_checkpoint, read_state_dict
from qurl.quant.named import quantize_named
from qurl.quant.uaq import apply_uaq
from qurl.types import GenRequest, SamplingParams

PROMPTS = ["12+34=", "What is 7*8? Answer:", "a", "Hello world, this is a longer prompt"]
# Mean KL(bf16 || 8-bit) per token, nats. Measured on this model (2 seeds): int8 ~3.7e-3, fp8 ~4.3e-2.
# Per-channel E4M3 keeps 3 mantissa bits (relative RMS error ~2.5x that of per-channel INT8 on
# Gaussian weights, and KL grows with the square), hence the separate bounds, each >= 2x the measure.
KL_BOUND = {"int8": 0.02, "fp8": 0.1}
UAQ_KL_BOUND = 0.01  # measured ~1e-4: the scaled and unscaled 8-bit models are the same up to rounding


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs with one torch thread (conftest.one_thread)."""


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3"])
def model_dir(request, tmp_path_factory):
    """The tiny Qwen2 preset, and the tiny Qwen3 one (q/k norms, head_dim 64 != 256 / 8)."""
    return build_model(tmp_path_factory.mktemp("m") / request.param, request.param, seed=1,
                       overrides={"num_hidden_layers": 2, "initializer_range": 0.1})


@pytest.fixture(scope="module")
def engines(model_dir):
    cache: dict = {}

    def get(precision: str) -> LocalEngine:
        if precision not in cache:
            cache[precision] = LocalEngine(model_dir, precision=precision, seed=0)
        return cache[precision]

    return get


def _reqs(tok, params: SamplingParams, prompts=PROMPTS, seeds=True) -> list[GenRequest]:
    from dataclasses import replace

    return [GenRequest(rid=f"r{i}", prompt_ids=tok.encode(p),
                       params=replace(params, seed=100 + i) if seeds else params)
            for i, p in enumerate(prompts)]


def _hf_logprobs(model, prompt_ids, out_ids, temperature) -> torch.Tensor:
    ids = torch.tensor([list(prompt_ids) + out_ids.tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    p = len(prompt_ids)
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits[p - 1 : -1] / t, dim=-1)
    return logp.gather(1, out_ids.unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("temperature,top_p", [(0.8, 0.9), (0.0, 1.0)])
def test_bf16_logprobs_equal_transformers_forward(model_dir, engines, temperature, top_p):
    eng = engines("bf16")
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p)
    results = eng.generate(_reqs(eng.tokenizer, params))
    hf, _ = load_checkpoint(model_dir)
    for r in results:
        assert len(r.output_ids) == len(r.logprobs) == len(r.versions) >= 1
        ref = _hf_logprobs(hf, r.prompt_ids, r.output_ids, temperature)
        assert (r.logprobs.double() - ref).abs().max() <= 1e-3
        assert r.versions.tolist() == [0] * len(r.output_ids)


def test_entropy_of_each_sampled_token_equals_transformers_forward(model_dir, engines):
    """GenResult.entropy: the entropy of softmax(logits / T) at every sampled position, the
    engine's own (int8 here: its 8-bit weights, so the reference is its own teacher-forced forward
    in float64) and, for the bf16 engine, transformers' forward of the checkpoint."""
    hf, _ = load_checkpoint(model_dir)
    for precision in ("bf16", "int8"):
        eng = engines(precision)
        results = eng.generate(_reqs(eng.tokenizer, SamplingParams(max_new_tokens=10, temperature=0.7,
                                                                     top_p=0.9)))
        for r in results:
            assert r.entropy is not None and r.entropy.shape == r.output_ids.shape
            ids = torch.tensor([list(r.prompt_ids) + r.output_ids.tolist()])
            with torch.no_grad():
                ref_model = hf if precision == "bf16" else eng.model
                z = ref_model(input_ids=ids).logits[0, len(r.prompt_ids) - 1:-1].double() / 0.7
            want = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
            torch.testing.assert_close(r.entropy.double(), want, rtol=1e-3, atol=1e-4)


def test_bf16_greedy_equals_generate(model_dir, engines):
    eng = engines("bf16")
    tok = eng.tokenizer
    results = eng.generate(_reqs(tok, SamplingParams(max_new_tokens=16, temperature=0.0)))
    hf, _ = load_checkpoint(model_dir)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)  # left padding, different lengths
    assert (enc.attention_mask == 0).any()
    out = hf.generate(**enc, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)[:, enc.input_ids.shape[1]:]
    for r, row in zip(results, out):
        want = row.tolist()
        if tok.eos_token_id in want:  # generate pads after EOS; the engine stops at it
            want = want[: want.index(tok.eos_token_id) + 1]
        assert r.output_ids.tolist() == want


def test_seeded_sampling_independent_of_batch(engines):
    eng = engines("bf16")
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95)
    batch = eng.generate(_reqs(eng.tokenizer, params))
    alone = eng.generate(_reqs(eng.tokenizer, params)[1:2])[0]
    assert alone.output_ids.tolist() == batch[1].output_ids.tolist()
    assert torch.allclose(alone.logprobs, batch[1].logprobs, atol=1e-5)
    again = eng.generate(_reqs(eng.tokenizer, params))
    assert [r.output_ids.tolist() for r in again] == [r.output_ids.tolist() for r in batch]


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_group_prompts_share_one_prefill(engines, model_dir, precision, monkeypatch):
    """Requests with the same prompt (a GRPO group) are prefilled once and their KV rows copied:
    each sample equals the same request generated alone (tokens exactly, logprobs to 1e-5), and
    the sampled logprobs still match a transformers forward of the whole sequence."""
    eng = engines(precision)
    group = [GenRequest(rid=f"g{i}", prompt_ids=eng.tokenizer.encode(PROMPTS[i % 2]),
                        params=SamplingParams(max_new_tokens=8, temperature=1.0, seed=7 + i))
             for i in range(6)]
    prefill_rows = []
    real = eng._forward
    monkeypatch.setattr(eng, "_forward", lambda ids, *a: prefill_rows.append(ids.shape) or real(ids, *a))
    together = eng.generate(group)
    assert prefill_rows[0][0] == 2  # two distinct prompts for six requests
    monkeypatch.setattr(eng, "_forward", real)
    for req, res in zip(group, together):
        alone = eng.generate([req])[0]
        assert alone.output_ids.tolist() == res.output_ids.tolist()
        assert torch.allclose(alone.logprobs, res.logprobs, atol=1e-5)
    if precision == "bf16":
        model, _ = load_checkpoint(model_dir)
        ref = _hf_logprobs(model, together[3].prompt_ids, together[3].output_ids, 1.0)
        assert torch.allclose(together[3].logprobs.double(), ref, atol=1e-4)


def test_stop_token_and_length(engines):
    eng = engines("bf16")
    tok = eng.tokenizer
    greedy = eng.generate(_reqs(tok, SamplingParams(max_new_tokens=12, temperature=0.0))[:1])[0]
    ids = greedy.output_ids.tolist()
    assert greedy.finish_reason == "length" and len(ids) == 12
    j = next(k for k in range(1, 12) if ids[k] not in ids[:k])  # first token not seen before
    stop = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(ids[j],))
    r = eng.generate(_reqs(tok, stop)[:1])[0]
    assert r.output_ids.tolist() == ids[: j + 1] and r.finish_reason == "stop"


def test_bad_requests_are_refused(engines):
    eng = engines("bf16")
    with pytest.raises(ValueError, match="r0.*temperature"):
        eng.generate([GenRequest("r0", [1, 2], SamplingParams(temperature=-1.0))])
    with pytest.raises(ValueError, match="r1.*token id 1000"):
        eng.generate([GenRequest("r1", [1, 1000])])
    with pytest.raises(ValueError, match="r2.*empty"):
        eng.generate([GenRequest("r2", [])])


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, [T], in float64."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_kl_to_bf16(engines, fmt, capsys):
    ref, q = engines("bf16"), engines(fmt)
    assert {m.weight.dtype for m in q._qlinears.values()} == {
        {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt]}
    assert len(q._qlinears) == 7 * 2
    samples = ref.generate(_reqs(ref.tokenizer, SamplingParams(max_new_tokens=16, temperature=1.0)))
    kls = torch.cat([_kl(ref.token_logits(r.prompt_ids, r.output_ids.tolist()),
                         q.token_logits(r.prompt_ids, r.output_ids.tolist())) for r in samples])
    with capsys.disabled():
        print(f"\n[{fmt}] KL(bf16 || {fmt}) per token: mean {kls.mean():.2e}, max {kls.max():.2e}")
    assert 0 < kls.mean() < KL_BOUND[fmt]  # > 0: the 8-bit path really changes the numbers
    # The engine's own returned logprobs are of its 8-bit weights.
    r = q.generate(_reqs(q.tokenizer, SamplingParams(max_new_tokens=8, temperature=1.0))[:1])[0]
    own = q.logprobs(r.prompt_ids, r.output_ids.tolist())
    assert torch.allclose(own, r.logprobs, atol=1e-3)


def test_int8_path_calls_int_mm(engines, monkeypatch):
    from qurl.engines.qlinear import Int8Linear

    q = engines("int8")
    monkeypatch.setattr(Int8Linear, "backend", "int_mm")  # the CPU default is FBGEMM (test_qlinear)
    calls = []
    real = torch._int_mm

    def counting(a, b):
        assert a.dtype == b.dtype == torch.int8
        calls.append(b.shape[1])
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", counting)
    q.generate(_reqs(q.tokenizer, SamplingParams(max_new_tokens=3, temperature=0.0))[:1])
    # prefill + 2 decode forwards, 2 layers each: q/k/v as one GEMM, o, gate/up as one, down
    assert len(calls) == 3 * 4 * 2
    cfg = q.model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    assert sorted(set(calls)) == sorted({qkv, cfg.hidden_size, 2 * cfg.intermediate_size})

@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_uaq_scaled_then_quantized_matches_unscaled(model_dir, engines, fmt):
    """Per-channel symmetric quantization is scale-equivariant: the codes of W/s are the codes of W
    and the per-token codes of s*x are those of x, so a UAQ-scaled 8-bit model computes the unscaled
    8-bit model's function up to fp32 rounding of the divisions (a rounding tie can flip a code by
    one step). Greedy outputs must therefore agree on >= 90% of tokens and the per-token KL must be
    within the same bound as the 8-bit-vs-bf16 test."""
    base = engines(fmt)
    scaled = LocalEngine(model_dir, precision=fmt, seed=0)
    scaled.load_weights(quantize_named(apply_uaq(read_state_dict(model_dir), 1.5), fmt), version=1)
    name = "model.layers.0.mlp.gate_proj.weight"
    assert not torch.equal(scaled._tensors[name + "_scale"], base._tensors[name + "_scale"])
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    a = base.generate(_reqs(base.tokenizer, params))
    b = scaled.generate(_reqs(base.tokenizer, params))
    agree = [x == y for ra, rb in zip(a, b) for x, y in zip(ra.output_ids.tolist(), rb.output_ids.tolist())]
    assert sum(agree) / len(agree) >= 0.9
    kls = torch.cat([_kl(base.token_logits(r.prompt_ids, r.output_ids.tolist()),
                         scaled.token_logits(r.prompt_ids, r.output_ids.tolist())) for r in a])
    assert kls.mean() < UAQ_KL_BOUND


# ---------------------------------------------------------------- load_weights and versions
def _snapshot(eng: LocalEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng._tensors.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_bad_chunk_names_tensor_and_changes_nothing(model_dir, precision):
    eng = LocalEngine(model_dir, precision=precision)
    eng.load_weights([], version=3)
    before = _snapshot(eng)
    sd = read_state_dict(model_dir)
    good = [(k, v + 0.01) for k, v in sd.items()]  # would change every tensor if applied
    q = "model.layers.1.self_attn.q_proj.weight"
    cases = {
        "model.layers.9.mlp.up_proj.weight": [*good, ("model.layers.9.mlp.up_proj.weight", sd[q])],
        q: [*good[:-1], (q, torch.zeros(3, 3))],
        "model.norm.weight": [*good, ("model.norm.weight", torch.full_like(sd["model.norm.weight"], float("nan")))],
    }
    for bad_name, chunks in cases.items():
        with pytest.raises(ValueError, match=bad_name.replace(".", r"\.")):
            eng.load_weights(iter(chunks), version=4)
        assert eng.version == 3
        assert _same(_snapshot(eng), before)


def test_8bit_pairs_are_validated(model_dir):
    eng = LocalEngine(model_dir, precision="int8")
    before = _snapshot(eng)
    q = dict(quantize_named(read_state_dict(model_dir), "int8"))
    name = "model.layers.0.mlp.down_proj.weight"
    without_scale = [(k, v) for k, v in q.items() if k != name + "_scale"]
    with pytest.raises(ValueError, match=f"{name}: 8-bit codes sent without"):
        eng.load_weights(without_scale, version=1)
    fp8_codes = dict(quantize_named(read_state_dict(model_dir), "fp8"))
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*float8"):
        eng.load_weights([(name, fp8_codes[name]), (name + "_scale", fp8_codes[name + "_scale"])], 1)
    with pytest.raises(ValueError, match="model.norm.weight: got 8-bit codes"):
        eng.load_weights([("model.norm.weight", torch.zeros(256, dtype=torch.int8))], 1)
    assert eng.version == 0 and _same(_snapshot(eng), before)
    bf16 = LocalEngine(model_dir, precision="bf16")
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.\w+\.\w+_proj\.weight: got 8-bit codes"):
        bf16.load_weights(q.items(), version=1)
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + "_scale: no tensor"):
        bf16.load_weights([(name + "_scale", q[name + "_scale"])], version=1)
    # Full precision in, quantized by the engine == quantized by the sender.
    eng.load_weights(read_state_dict(model_dir).items(), version=1)
    assert torch.equal(eng._tensors[name], q[name]) and torch.equal(eng._tensors[name + "_scale"], q[name + "_scale"])


def test_adopt_takes_a_whole_model_without_copying_and_copies_anything_less(model_dir):
    sd = {k: v * 1.01 for k, v in read_state_dict(model_dir).items()}
    chunks = list(quantize_named(sd, "int8"))
    copied, adopting = LocalEngine(model_dir, precision="int8"), LocalEngine(model_dir, precision="int8")
    copied.load_weights(iter(chunks), version=1)
    adopting.load_weights(iter(chunks), version=1, adopt=True)
    assert adopting.adopted and not copied.adopted
    held = dict(chunks)
    for name, t in adopting._tensors.items():  # the engine's tensors are the chunks themselves
        src = held[name if name in held else "model.embed_tokens.weight"]  # tied lm_head
        assert t.data_ptr() == src.data_ptr(), name
    tied = adopting.model.get_output_embeddings().weight
    assert tied.data_ptr() == adopting.model.get_input_embeddings().weight.data_ptr()
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    a = adopting.generate(_reqs(adopting.tokenizer, params))
    b = copied.generate(_reqs(copied.tokenizer, params))
    assert [r.output_ids.tolist() for r in a] == [r.output_ids.tolist() for r in b]
    # less than the whole model: copied, so the engine holds nothing of the caller's memory
    part = [(n, t.clone()) for n, t in chunks if "layers.0." in n]
    adopting.load_weights(iter(part), version=2, adopt=True)
    assert not adopting.adopted and adopting.version == 2
    assert all(adopting._tensors[n].data_ptr() != t.data_ptr() for n, t in part)


def test_version_committed_after_last_chunk(model_dir):
    eng = LocalEngine(model_dir, precision="int8")
    seen = []

    def chunks():
        for k, v in quantize_named(read_state_dict(model_dir), "int8"):
            seen.append(eng.version)
            yield k, v

    eng.load_weights(chunks(), version=7)
    assert set(seen) == {0} and len(seen) > 1 and eng.version == 7


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_partial_rollout_versions(model_dir, precision):
    """A weight update landing after k decode steps: tokens 1..k keep version v, the rest v+1, and
    the first k tokens are exactly those of an uninterrupted run."""
    k, n = 3, 8
    eng = LocalEngine(model_dir, precision=precision, eos_token_ids=())
    eng.load_weights([], version=5)
    params = SamplingParams(max_new_tokens=n, temperature=1.0)
    plain = eng.generate(_reqs(eng.tokenizer, params))
    new = {name: -t for name, t in read_state_dict(model_dir).items()}  # clearly different weights
    calls = []

    def between():
        calls.append(eng.version)
        if len(calls) == k:
            eng.load_weights(quantize_named(new, precision), version=6)

    mixed = eng.generate(_reqs(eng.tokenizer, params), between_steps=between)
    assert len(calls) == n - 1  # called between decode steps only
    for a, b in zip(plain, mixed):
        assert b.versions.tolist() == [5] * k + [6] * (n - k)
        assert b.output_ids[:k].tolist() == a.output_ids[:k].tolist()
        assert torch.equal(b.logprobs[:k], a.logprobs[:k])
        assert not torch.allclose(b.logprobs[k:], a.logprobs[k:])
    assert eng.version == 6


def test_implements_engine_protocol(engines):
    from qurl.types import Engine

    eng = engines("int8")
    assert isinstance(eng, Engine) and eng.version == 0
    assert eng.generate([]) == []

    class Unclosable:  # everything an engine has but close(): whoever made it cannot release it
        tokenizer, vocab_size, version = None, 0, 0

        def generate(self, requests, between_steps=None):
            return []

        def load_weights(self, chunks, version):
            pass

    assert not isinstance(Unclosable(), Engine)
    eng.close()
    eng.close()  # closing twice is harmless
    assert eng.generate([]) == []  # the local engine holds nothing outside the process
    with pytest.raises(ValueError, match="precision must be one of"):
        LocalEngine("/nonexistent", precision="int4")
