"""`qurl export` (qurl/commands/export.py): a trained run's policy out as an HF checkpoint that
transformers loads with the learner's logits, UAQ undone to fp32 rounding, and as the 8-bit
checkpoint SGLang loads, byte-equal to what the run's weight sync sends.

Three short runs of the main job: a tiny Qwen3 in fp32 with UAQ s=1.5 at TP 1 (trained: lr 1e-3),
the same on the tiny Qwen2 with UAQ off, and a tiny Qwen2 in bf16 with UAQ s=1.5 at TP 2 with lr
1e-30 (updates below fp32 resolution: its masters stay the UAQ-scaled base, so the HF export must
equal the base checkpoint to fp32 rounding).
"""
from __future__ import annotations

import json

import pytest
import torch

from qurl.cli import main
from qurl.config import load_config
from qurl.commands.train import train

pytestmark = pytest.mark.slow


def _cfg(root, name: str, **extra):
    sets = {"deploy.dir": str(root), "run.name": name, "run.steps": 2, "run.eval_every": 0,
            "deploy.ckpt_every": 1, "deploy.progress": False, "model.warmstart_steps": 10,
            "data.digits": 1, "data.operands": 2, "data.train_size": 50,
            "rollout.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 12,
            "eval.max_new_tokens": 12, "data.eval_size": 4, "eval.fp_policy": False,
            "algo.uaq_scale": 1.5, "optim.lr": 1e-3}
    sets.update(extra)
    return load_config(sets=[f"{k}={v}" for k, v in sets.items()])


@pytest.fixture(scope="module")
def runs(runs_dir):
    from pipeline_helpers import use_free_dist_port

    use_free_dist_port()
    root = runs_dir("export")
    qwen3 = _cfg(root, "qwen3", **{"model.base": "tiny-qwen3", "model.dtype": "float32"})
    plain = _cfg(root, "plain", **{"model.dtype": "float32", "algo.uaq_scale": 1.0})
    frozen = _cfg(root, "frozen", **{"model.dtype": "bfloat16", "learner.tp": 2, "optim.lr": 1e-30})
    from qurl.commands.ranks import run_ranks

    run_ranks(train, frozen.learner, frozen, resume=False)  # TP 2: two spawned learner ranks
    train(qwen3)  # in this process (TP 1)
    train(plain)
    return root


def _masters(run_dir):
    """The fp32 masters of the run's latest checkpoint, as the learner streams them (TP 1)."""
    from qurl.checkpoint.rundir import CheckpointDir, read_config
    from qurl.learner.dist import init_learner_dist
    from qurl.learner.megatron import MegatronLearner
    from qurl.models.base import base_dir

    cfg = read_config(run_dir)
    init_learner_dist(cfg.learner, 0, 1, ranks=cfg.deploy.ranks, host=cfg.deploy.host)
    learner = MegatronLearner(str(base_dir(cfg.model, run_dir)), cfg.model, cfg.algo, cfg.optim, cfg.learner,
                              total_steps=cfg.run.steps, seed=cfg.run.seed, ranks=cfg.deploy.ranks)
    learner.load(CheckpointDir(run_dir).latest())
    return learner, {k: v.detach().clone() for k, v in learner.named_weights()}


@pytest.mark.parametrize("run, arch, s", [("qwen3", "Qwen3ForCausalLM", 1.5),
                                          ("plain", "Qwen2ForCausalLM", 1.0)])
def test_hf_export_loads_in_transformers_with_the_learners_logits(runs, tmp_path, run, arch, s):
    """UAQ on (Qwen3) and off (Qwen2), both trained in fp32 at TP 1."""
    from transformers import AutoModelForCausalLM

    from qurl.quant.uaq import apply_uaq

    out = tmp_path / "hf"
    assert main(["export", str(runs / run), "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch] and "quantization_config" not in cfg
    for f in ("tokenizer.json", "generation_config.json"):
        assert (out / f).is_file(), f
    learner, masters = _masters(runs / run)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(1, 40, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = learner.logits(tokens).cpu(), model(tokens).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    # UAQ undone: scaling the export again gives the learner's masters to fp32 rounding
    exported = {k: v.float() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    rescaled = apply_uaq(exported, s)
    for name, t in masters.items():
        torch.testing.assert_close(rescaled[name], t, rtol=2e-7 if s != 1 else 0, atol=1e-9 if s != 1 else 0,
                                   msg=name)
    norm = "model.layers.0.input_layernorm.weight"
    # undone, not left as is (UAQ on); with UAQ off the export is the masters, bit for bit
    assert torch.allclose(exported[norm], masters[norm]) == (s == 1)


def test_hf_export_of_an_untrained_tp2_bf16_run_equals_its_base(runs, tmp_path):
    from qurl.checkpoint.rundir import read_config
    from qurl.models.hf import read_state_dict
    from qurl.models.base import base_dir

    out = tmp_path / "frozen"
    assert main(["export", str(runs / "frozen"), "--out", str(out), "--dtype", "float32"]) == 0
    base = read_state_dict(base_dir(read_config(runs / "frozen").model, runs / "frozen"))
    got = read_state_dict(out)
    assert sorted(got) == sorted(base)
    for name, t in base.items():  # UAQ undone in fp32: x / 1.5 * 1.5 is x to one rounding
        torch.testing.assert_close(got[name], t.float(), rtol=2e-7, atol=0, msg=name)


def test_int8_export_is_byte_equal_to_what_the_sync_sends(runs, tmp_path):
    from qurl.models.hf import read_state_dict
    from qurl.quant.named import engine_chunks

    out = tmp_path / "int8"
    assert main(["export", str(runs / "qwen3"), "--out", str(out), "--format", "int8"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] \
        == "w8a8_int8"
    _, masters = _masters(runs / "qwen3")
    sent = dict(engine_chunks(masters.items(), "int8", wire_dtype=torch.bfloat16))
    got = read_state_dict(out)
    assert sorted(got) == sorted(sent)
    for name, t in sent.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert any(t.dtype == torch.int8 for t in got.values())


def test_export_errors_are_one_line(runs, tmp_path, capsys):
    assert main(["export", str(runs / "qwen3"), "--out", str(tmp_path / "x"), "--step", "7"]) == 2
    assert "no checkpoint of step 7" in capsys.readouterr().err


def test_the_exported_policy_answers_as_the_run_does(runs, tmp_path, capsys):
    """A trained policy leaves qurl and comes back: `qurl eval` on the HF export of the run's last
    checkpoint, under the run's own config.toml, gives the same greedy answers, word for word,
    and the same accuracies as `qurl eval` of the run itself (issue 58: export, then
    re-evaluate). The checkpoint directory is read as a run's step 0 would read its base."""
    out = tmp_path / "hf"
    assert main(["export", str(runs / "qwen3"), "--out", str(out), "--dtype", "float32"]) == 0
    recs = {}
    for name, cmd in (("trained", [str(runs / "qwen3")]),
                      ("export", [str(out), "--config", str(runs / "qwen3" / "config.toml")])):
        assert main(["eval", *cmd, "--answers", "--out", str(tmp_path / f"{name}.json")]) == 0
        recs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    trained, again = recs["trained"], recs["export"]
    texts = trained["eval_answers"]["synthetic/greedy"]
    assert len(texts) == 4 and any(t.strip() for t in texts)  # answers to compare, not blanks
    assert again["eval_answers"] == trained["eval_answers"]
    scores = [k for k in trained if k.startswith("eval/") and k.endswith("/greedy")]
    assert scores and {k: again[k] for k in scores} == {k: trained[k] for k in scores}
    assert again["step"] == 0 and trained["step"] == 2
    # the wrong inputs are one line each: an 8-bit export, --step on a checkpoint, --config on a run
    assert main(["export", str(runs / "qwen3"), "--out", str(tmp_path / "i8"), "--format", "int8"]) == 0
    capsys.readouterr()
    for cmd, says in (([str(tmp_path / "i8")], "an 8-bit export"),
                      ([str(out), "--step", "1"], "a checkpoint directory, not a run"),
                      ([str(runs / "qwen3"), "--preset", "cpu-tiny"], "is a run directory")):
        assert main(["eval", *cmd]) == 2, cmd
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err, err


def test_an_export_based_run_quantizes_as_the_run_did(runs, runs_dir, tmp_path):
    """The export made the base of a new run (same precision and UAQ scale, no warm start, a
    learning rate too small to move an fp32 weight): what its engine is given equals the trained
    run's, scales to fp32 rounding (UAQ re-applied: x * s / s) and codes but for the odd one on a
    rounding tie."""
    out = tmp_path / "hf"
    assert main(["export", str(runs / "qwen3"), "--out", str(out), "--dtype", "float32"]) == 0
    root = runs_dir("export_again")
    train(_cfg(root, "again", **{"model.base": str(out), "model.dtype": "float32",
                                  "run.steps": 1, "model.warmstart_steps": 0,
                                  "optim.lr": 1e-30}))
    # what the engines were given: the 8-bit weights of both runs agree, scales to fp32 rounding
    # (UAQ re-applied: x * s / s) and codes but for the odd one on a rounding tie
    from qurl.models.hf import read_state_dict

    for run, where in ((runs / "qwen3", tmp_path / "a8"), (root / "again", tmp_path / "b8")):
        assert main(["export", str(run), "--out", str(where), "--format", "int8"]) == 0
    a8, b8 = read_state_dict(tmp_path / "a8"), read_state_dict(tmp_path / "b8")
    assert sorted(a8) == sorted(b8)
    codes = [n for n, t in a8.items() if t.dtype == torch.int8]
    same = sum(int((a8[n] == b8[n]).sum()) for n in codes) / sum(a8[n].numel() for n in codes)
    assert same > 0.9999, same
    for n, t in a8.items():
        if t.dtype != torch.int8:
            torch.testing.assert_close(b8[n].float(), t.float(), rtol=1e-6, atol=0, msg=n)
