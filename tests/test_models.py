"""Locally built models and tokenizer: save/reload through the Auto classes offline, checkpoint
checks that name what is wrong, safetensors read/write, and the supervised warm start."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from qurl.models import warmstart as ws
from qurl.models.hf import (build_model, check_checkpoint, load_checkpoint, param_count,
                            read_state_dict, write_state_dict)
from qurl.models.tokenizer import build_tokenizer
from qurl.models.warmstart import completion_loss, sft_warmstart

MICRO = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs with one torch thread (conftest.one_thread)."""


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m") / "micro", "tiny", seed=0, overrides=MICRO)


def test_tokenizer_round_trip_and_specials():
    tok = build_tokenizer()
    assert len(tok) == 100
    text = "Q: 12+34=?\nA: 46 \\boxed{46} ~`|"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.decode([tok.eos_token_id]) == "<|endoftext|>"
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<|im_start|>")]
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]


def test_chat_template():
    tok = build_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_tiny_preset_builds_reloads_offline(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_model(tmp_path / "tiny", "tiny", seed=3)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    model, tok = load_checkpoint(path)
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert 3_000_000 <= param_count(model) <= 5_000_000
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads and cfg.tie_word_embeddings
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2 qkv bias
    again = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    ids = torch.tensor([tok.encode("12+34=")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert AutoTokenizer.from_pretrained(path).encode("12+34=") == ids[0].tolist()
    # Same seed, same weights; the caller's RNG stream is left alone.
    state = torch.random.get_rng_state()
    other = build_model(tmp_path / "tiny2", "tiny", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    a, b = read_state_dict(path), read_state_dict(other)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_preset():
    with pytest.raises(ValueError, match="model preset must be one of"):
        build_model("/nonexistent", "huge")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("remove,named", [
    ("config.json", "missing config.json"),
    ("model.safetensors", "missing model.safetensors"),
    ("tokenizer.json", "missing tokenizer.json"),
])
def test_missing_files_are_named(micro_dir, tmp_path, remove, named):
    d = _copy(micro_dir, tmp_path / "ck")
    (d / remove).unlink()
    with pytest.raises(ValueError, match=named) as err:
        check_checkpoint(d)
    assert str(d) in str(err.value)
    with pytest.raises(ValueError, match=named):
        load_checkpoint(d)


@pytest.mark.parametrize("field,value", [("architectures", ["GPT2LMHeadModel"]), ("model_type", "gpt2")])
def test_unsupported_architecture_is_named(micro_dir, tmp_path, field, value):
    d = _copy(micro_dir, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"field '{field}'.*not supported"):
        check_checkpoint(d)


def test_sharded_write_read_and_load(micro_dir, tmp_path):
    d = _copy(micro_dir, tmp_path / "ck")
    sd = read_state_dict(d)
    (d / "model.safetensors").unlink()
    files = write_state_dict(d, sd, max_shard_bytes=20_000)
    assert len(files) > 2 and (d / "model.safetensors.index.json").is_file()
    back = read_state_dict(d)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    model, _ = load_checkpoint(d)  # from_pretrained follows the index
    assert torch.equal(model.model.embed_tokens.weight, sd["model.embed_tokens.weight"])
    files[0].unlink()
    with pytest.raises(ValueError, match=f"missing weight shard {files[0].name}"):
        check_checkpoint(d)


def test_llama_checkpoint_loads(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    model, _ = load_checkpoint(tmp_path / "llama")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert "lm_head.weight" in read_state_dict(tmp_path / "llama")  # untied


PAIRS = [(f"{a}+{b}=", f"{a + b} \\boxed{{{a + b}}}") for a in range(10, 40, 3) for b in (7, 21)]


def test_warmstart_lowers_loss_and_is_deterministic(micro_dir, tmp_path):
    model, tok = load_checkpoint(micro_dir)
    before = completion_loss(model, tok, PAIRS)
    kw = dict(steps=12, lr=3e-3, batch_size=8, seed=5, bf16_autocast=False, num_threads=1)
    out1 = sft_warmstart(micro_dir, PAIRS, out_dir=tmp_path / "a", **kw)
    out2 = sft_warmstart(micro_dir, PAIRS, out_dir=tmp_path / "b", **kw)
    tuned, _ = load_checkpoint(out1)
    after = completion_loss(tuned, tok, PAIRS)
    assert after < before - 0.5, (before, after)  # mean NLL per completion token, nats
    log = json.loads((out1 / "warmstart.json").read_text())
    assert len(log["losses"]) == 12 and log["loss_last"] < log["loss_first"]
    a, b = read_state_dict(out1), read_state_dict(out2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    check_checkpoint(out1)  # a complete checkpoint the engine and learner can load


def test_warmstart_rejects_bad_input(micro_dir, tmp_path):
    with pytest.raises(ValueError, match="pairs is empty"):
        sft_warmstart(micro_dir, [], steps=1, lr=1e-3, batch_size=2, seed=0, out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"pairs\[0\].*exceed"):
        sft_warmstart(micro_dir, [("x" * 600, "y")], steps=1, lr=1e-3, batch_size=2, seed=0,
                      out_dir=tmp_path)


def test_base_model_key_follows_the_recipe_not_the_rl_prompt_count():
    """One warm-started base per recipe: the cache key ignores data.train_size (the warm start has
    its own fixed questions) but changes with everything the warm start reads."""
    from qurl.config import load_config
    from qurl.models.base import _base_key

    def key_of(cfg):
        return _base_key(cfg.model, cfg.data, cfg.run.seed)

    key = key_of(load_config())
    assert key_of(load_config(sets=["data.train_size=16"])) == key
    for changed in ("run.seed=1", "model.warmstart_steps=40", "model.warmstart_lr=1e-3",
                    "data.digits=2", "data.operands=2", "data.template=boxed", "model.base=small"):
        assert key_of(load_config(sets=[changed])) != key, changed


def _checkpoint_cfg(base, tmp_path, *sets):
    from qurl.config import load_config

    return load_config(sets=[f"model.base={base}", f"deploy.dir={tmp_path / 'runs'}",
                             "deploy.torch_threads=1", *sets])


def _recipe(cfg):
    """build_base's arguments (qurl/models/base.py) from a run's config."""
    return cfg.model, cfg.data, cfg.run.seed, cfg.deploy


def test_a_checkpoint_base_is_used_as_given_unless_warm_start_is_asked(micro_dir, tmp_path):
    """The default warmstart_steps (250, the tiny model's recipe) must not fine-tune a checkpoint
    on its own: without model.warmstart_checkpoint the run reads model.base where it is."""
    from qurl.models.base import build_base, builds_base, prepare_base_model

    cfg = _checkpoint_cfg(micro_dir, tmp_path)
    assert cfg.model.warmstart_steps == 250 and not builds_base(cfg.model)
    assert prepare_base_model(*_recipe(cfg), tmp_path / "run") == str(micro_dir)
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()
    with pytest.raises(ValueError, match="no base to build"):
        build_base(*_recipe(cfg))
    assert not builds_base(_checkpoint_cfg(micro_dir, tmp_path, "model.warmstart_checkpoint=true",
                                           "model.warmstart_steps=0").model)


def test_a_checkpoint_is_warm_started_on_the_synthetic_recipe(micro_dir, tmp_path):
    """model.warmstart_checkpoint: the checkpoint is fine-tuned on worked solutions of the warm
    start's 2000 synthetic questions (rendered with the checkpoint's own tokenizer), cached once,
    and hard-linked into each run dir; the weights are those of the same fine-tune run by hand."""
    from qurl.data.synthetic import arithmetic_task, worked_solution
    from qurl.models.base import prepare_base_model

    cfg = _checkpoint_cfg(micro_dir, tmp_path, "model.warmstart_checkpoint=true",
                          "model.warmstart_steps=3", "model.warmstart_lr=1e-3", "run.seed=4")
    got = Path(prepare_base_model(*_recipe(cfg), tmp_path / "run_a"))
    assert got == tmp_path / "run_a" / "base_model"
    check_checkpoint(got)
    log = json.loads((got / "warmstart.json").read_text())
    assert (log["steps"], log["lr"], log["batch_size"], log["seed"], log["pairs"]) == (3, 1e-3, 32, 4, 2000)

    questions = arithmetic_task(2000, seed=4, split="train", digits=cfg.data.digits,
                                n_operands=cfg.data.operands, at_most=True)
    pairs = [(q.prompt, worked_solution(q)) for q in questions]  # template "plain": the bare question
    by_hand = sft_warmstart(micro_dir, pairs, steps=3, lr=1e-3, batch_size=32, seed=4,
                            out_dir=tmp_path / "by_hand", num_threads=1)
    tuned, ref, start = read_state_dict(got), read_state_dict(by_hand), read_state_dict(micro_dir)
    assert all(torch.equal(tuned[k], ref[k]) for k in ref)
    assert any(not torch.equal(tuned[k], start[k]) for k in start)

    cached = [p for p in (tmp_path / "runs" / "_base").iterdir() if p.is_dir()]  # beside: its .lock
    assert len(cached) == 1 and cached[0].name.startswith(micro_dir.name + "-")
    again = Path(prepare_base_model(*_recipe(cfg), tmp_path / "run_b"))  # a second run: the cache, linked
    assert [p.name for p in (tmp_path / "runs" / "_base").iterdir() if p.is_dir()] == [cached[0].name]
    weights = "model.safetensors"
    assert (again / weights).stat().st_ino == (cached[0] / weights).stat().st_ino == (got / weights).stat().st_ino


def test_a_base_built_apart_is_the_cache_build_base_reads(micro_dir, tmp_path):
    """A study builds its warm start in a child process (its freed memory then goes back to the
    system): the child writes the cache build_base would, and its errors reach the caller."""
    from qurl.models.base import build_base, build_base_apart

    cfg = _checkpoint_cfg(micro_dir, tmp_path, "model.warmstart_checkpoint=true",
                          "model.warmstart_steps=1", "run.seed=2")
    got = build_base_apart(*_recipe(cfg))
    assert got.parent == tmp_path / "runs" / "_base" and (got / "warmstart.json").is_file()
    check_checkpoint(got)
    mtime = (got / "model.safetensors").stat().st_mtime_ns
    assert build_base(*_recipe(cfg)) == got  # found in the cache, not built again
    assert (got / "model.safetensors").stat().st_mtime_ns == mtime
    assert not any(micro_dir.name in p.name and p.name.endswith(".tmp") for p in got.parent.iterdir())
    with pytest.raises(ValueError, match="no base to build"):
        build_base_apart(*_recipe(_checkpoint_cfg(micro_dir, tmp_path)))


def test_the_warm_start_cache_key_follows_the_checkpoint(micro_dir, tmp_path):
    from qurl.models.base import _base_key

    other = tmp_path / "other"
    shutil.copytree(micro_dir, other)
    sets = ("model.warmstart_checkpoint=true",)
    def key_of():
        cfg = _checkpoint_cfg(other, tmp_path, *sets)
        return _base_key(cfg.model, cfg.data, cfg.run.seed, other)

    key = key_of()
    assert key_of() == key
    conf = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**conf, "rms_norm_eps": 1e-5}))
    assert key_of() != key
    (other / "config.json").write_text(json.dumps(conf))
    (other / "extra.bin").write_bytes(b"x")
    assert key_of() != key


def test_warm_starting_a_checkpoint_needs_the_synthetic_task(micro_dir, tmp_path):
    from qurl.config import ConfigError

    with pytest.raises(ConfigError, match="model.warmstart_checkpoint.*data.train='x.jsonl'"):
        _checkpoint_cfg(micro_dir, tmp_path, "model.warmstart_checkpoint=true", "data.train=x.jsonl")
    _checkpoint_cfg(micro_dir, tmp_path, "data.train=x.jsonl")  # used as given: nothing to check


def test_a_child_killed_outright_is_an_error_not_a_wait():
    """A warm-start child killed by the kernel (out of memory) must fail the study that started it:
    multiprocessing.Pool would wait for it forever. os.abort kills the child by SIGABRT."""
    import os
    import threading

    from qurl.models.base import run_apart

    got: list[BaseException] = []

    def call() -> None:
        try:
            run_apart(os.abort)
        except BaseException as e:  # noqa: BLE001 - the test inspects what came back
            got.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "run_apart still waiting for a child that was killed"
    assert len(got) == 1 and isinstance(got[0], RuntimeError) and "abort died" in str(got[0])
    assert run_apart(divmod, 7, 2) == (3, 1)  # a child that returns: its result comes back


def test_a_second_builder_of_the_same_base_waits_for_the_first(micro_dir, tmp_path):
    """Two studies (or two arms of one seed) asking for the same warm start at once would share its
    .tmp dir: build_base holds a file lock beside the cache while it looks and builds, so a second
    caller waits for the first and then finds the cache."""
    import fcntl
    import threading

    from qurl.models.base import build_base

    cfg = _checkpoint_cfg(micro_dir, tmp_path, "model.warmstart_checkpoint=true",
                          "model.warmstart_steps=1", "run.seed=3")
    first = build_base(*_recipe(cfg))
    (lock,) = (tmp_path / "runs" / "_base").glob("*.lock")
    got: list[Path] = []
    with open(lock, "w") as held:  # as a builder in another process would
        fcntl.flock(held, fcntl.LOCK_EX)
        t = threading.Thread(target=lambda: got.append(build_base(*_recipe(cfg))), daemon=True)
        t.start()
        t.join(3)
        assert t.is_alive() and not got, "build_base went past a lock another builder holds"
    t.join(60)  # closing the file released the lock
    assert got == [first] and (first / "warmstart.json").is_file()


def test_warm_start_uses_bf16_matmuls_on_every_cpu(micro_dir, tmp_path, monkeypatch):
    """By default the warm start rounds like bf16 autocast: natively where the CPU can, emulated
    elsewhere (forced here), never silently in fp32; the record says which."""
    pairs = [(f"{a}+{b}=", f"{a + b} \\boxed{{{a + b}}}") for a in range(10, 40, 3) for b in (7, 21)]
    kw = dict(steps=4, lr=3e-3, batch_size=8, seed=5, num_threads=1)
    native = ws.cpu_has_native_bf16()
    default = json.loads((ws.sft_warmstart(micro_dir, pairs, out_dir=tmp_path / "d", **kw)
                          / "warmstart.json").read_text())
    assert (default["bf16_autocast"], default["bf16_matmul"]) == (True, "native" if native else "emulated")
    monkeypatch.setattr(ws, "cpu_has_native_bf16", lambda: False)
    emu = ws.sft_warmstart(micro_dir, pairs, out_dir=tmp_path / "e", **kw)
    again = ws.sft_warmstart(micro_dir, pairs, out_dir=tmp_path / "e2", **kw)
    fp32 = ws.sft_warmstart(micro_dir, pairs, out_dir=tmp_path / "f", bf16_autocast=False, **kw)
    assert json.loads((emu / "warmstart.json").read_text())["bf16_matmul"] == "emulated"
    assert json.loads((fp32 / "warmstart.json").read_text())["bf16_matmul"] is None
    a, b, c = read_state_dict(emu), read_state_dict(again), read_state_dict(fp32)
    assert all(torch.equal(a[k], b[k]) for k in a)  # deterministic
    assert not all(torch.equal(a[k], c[k]) for k in a)  # and not the fp32 run


@pytest.mark.parametrize("edit,named", [
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
      "num_experts_per_tok": 9, "moe_intermediate_size": 64, "norm_topk_prob": True},
     "num_experts_per_tok=9"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
      "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64},
     "shared experts"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_experts": 8}, "experts"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
])
def test_qurl_train_refuses_an_unsupported_checkpoint_in_one_line(micro_dir, tmp_path, capsys,
                                                                   edit, named):
    """Before any learner rank starts: exit 2, one line naming the field and what is supported."""
    from qurl.cli import main

    d = _copy(micro_dir, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    rc = main(["train", "--set", f"model.base={d}", "--set", f"deploy.dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert named in err[0] and "Qwen2, Qwen3 and Llama" in err[0]
    assert not (tmp_path / "runs").exists()  # nothing started


def test_a_checkpoint_missing_its_weights_is_refused_before_the_ranks(micro_dir, tmp_path, capsys):
    from qurl.cli import main

    d = _copy(micro_dir, tmp_path / "ck")
    (d / "model.safetensors").unlink()
    assert main(["train", "--set", f"model.base={d}"]) == 2
    assert "missing model.safetensors" in capsys.readouterr().err
