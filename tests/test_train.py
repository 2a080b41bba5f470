"""The main job end to end at a tiny size: sync QuRL loop, checkpoints, exact resume, report."""
import json
import math

import pytest

from qurl.cli import main
from qurl.config import ConfigError, load_config, validate
from qurl.data.splits import load_eval_sets
from qurl.errors import CheckpointError
from qurl.commands.eval import eval_run
from qurl.research.studies.misses import classify
from qurl.research.studies.misses import report as misses_report
from qurl.commands.train import train
from qurl.train.metrics_log import read_metrics
from qurl.train.plots import report

pytestmark = pytest.mark.slow

# Timing fields differ run to run; everything else must match exactly (up to float noise).
TIMING = ("time/", "tokens_per_s", "sync/time")


@pytest.fixture(scope="module")
def runs_root(runs_dir):
    """One runs/ dir for the module; the warm-started base model comes from the session's shared
    cache (conftest.runs_dir)."""
    from pipeline_helpers import use_free_dist_port

    use_free_dist_port()  # not 29500: another test run on this machine may hold it
    return runs_dir("runs")


def small_cfg(tmp_path, name, steps, **extra):
    sets = {
        "deploy.dir": str(tmp_path), "run.name": name, "run.steps": steps, "run.eval_every": 0,
        "deploy.ckpt_every": 1, "deploy.progress": False, "model.warmstart_steps": 40,
        # one-digit sums: a briefly warm-started model is right sometimes, so rewards, advantages
        # and gradients are non-zero and exact resume is a real claim
        "data.digits": 1, "data.operands": 2, "data.train_size": 100,
        "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 16,
        "eval.max_new_tokens": 16, "data.eval_size": 8,
        "optim.lr": 1e-3,
    }
    sets.update(extra)
    return load_config(sets=[f"{k}={v}" for k, v in sets.items()])


def comparable(records):
    out = []
    for r in records:
        out.append({k: v for k, v in r.items() if not any(t in k for t in TIMING)})
    return out


def assert_records_close(a, b, rel=1e-5):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys(), (ra.keys() ^ rb.keys())
        for k in ra:
            if isinstance(ra[k], float):
                assert math.isclose(ra[k], rb[k], rel_tol=rel, abs_tol=1e-7), (ra["step"], k, ra[k], rb[k])
            else:
                assert ra[k] == rb[k], (k, ra[k], rb[k])


def test_resume_is_exact(runs_root):
    tmp_path = runs_root
    k = 2
    straight = small_cfg(tmp_path, "straight", 2 * k)
    train(straight)
    first = small_cfg(tmp_path, "split", k)
    train(first)
    # resume with more steps: same run dir, only run.steps changes (allowed)
    resumed = small_cfg(tmp_path, "split", 2 * k)
    train(resumed, resume=True)
    a = comparable(read_metrics(tmp_path / "straight" / "metrics.jsonl"))
    b = comparable(read_metrics(tmp_path / "split" / "metrics.jsonl"))
    # the split run evaluates at step k (its end) too; compare the train records and the final eval
    a_train = [r for r in a if r["kind"] == "train"]
    b_train = [r for r in b if r["kind"] == "train"]
    assert [r["step"] for r in a_train] == list(range(1, 2 * k + 1))
    assert_records_close(a_train, b_train)
    assert_records_close([r for r in a if r["kind"] == "eval"][-1:],
                         [r for r in b if r["kind"] == "eval"][-1:])
    # the comparison is not vacuous: the policy really moved and the 8-bit codes changed
    assert any(r["grad_norm"] > 0 for r in a_train)
    assert 0 < sum(r["reward"] for r in a_train) < len(a_train)
    assert any(r["flip_frac"] > 0 for r in a_train if "flip_frac" in r)
    png = report(tmp_path / "split")
    assert png.exists() and png.stat().st_size > 10_000


def test_resume_refuses_immutable_change_and_fresh_overwrite(runs_root):
    tmp_path = runs_root
    cfg = small_cfg(tmp_path, "r", 1)
    train(cfg)
    with pytest.raises(ConfigError, match="algo.uaq_scale"):
        train(small_cfg(tmp_path, "r", 2, **{"algo.uaq_scale": 1.0}), resume=True)
    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg)
    # the CLI reports config errors as a message and exit code 2, not a traceback
    assert main(["train", "--set", "algo.loss=nope"]) == 2
    saved = (tmp_path / "r" / "config.toml").read_text()
    assert 'loss = "acr"' in saved and "uaq_scale = 1.5" in saved
    recs = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["kind"] for r in recs] == ["eval", "train", "eval"]
    # `qurl eval` rebuilds the 8-bit actor from the checkpoint and scores what training's last eval did
    assert eval_run(tmp_path / "r")["accuracy"] == recs[-1]["accuracy"]
    json.dumps(recs)  # strictly JSON (no NaN literals)
    # --step names the checkpoint; --answers keeps the greedy answers, whose kinds
    # (qurl/research/studies/misses.py) agree with the right answers the evaluation counted
    got = eval_run(tmp_path / "r", step=1, answers=True, per_question=True)
    texts, counts = got["eval_answers"]["synthetic/greedy"], got["eval_counts"]["synthetic/greedy"]
    cfg = validate(cfg)
    exs = load_eval_sets(cfg.data, cfg.run.seed)["synthetic"]
    assert len(texts) == len(exs) == got["n"]
    assert [int(classify(t, ex.answer, ex.answer_kind).kind == "right")
            for t, ex in zip(texts, exs)] == counts
    (tmp_path / "ans.json").write_text(json.dumps(got))
    line, = misses_report(tmp_path / "r", [tmp_path / "ans.json"])
    assert line.startswith("step 1 synthetic/greedy: right ")
    assert line.endswith(f"accuracy {got['eval/synthetic/greedy']:.3f} of {len(exs)}")
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 7 \(there are: 1\)"):
        eval_run(tmp_path / "r", step=7)


def test_eval_records_hold_every_set_both_policies_and_their_gap(runs_root):
    """The paper's evaluation in training and in `qurl eval`: per set and mean, greedy, Avg@k and
    pass@k, for the 8-bit engine (eval/), the full-precision policy (eval_fp/) and the gap."""
    cfg = small_cfg(runs_root, "ev", 1, **{"data.eval": "synthetic,amc23", "data.eval_size": 3,
                                         "eval.samples": 2, "eval.pass_k": "1,2"})
    train(cfg)
    recs = [r for r in read_metrics(runs_root / "ev" / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in recs] == [0, 1]
    for rec in recs:
        for who in ("eval", "eval_fp"):
            for s in ("synthetic", "amc23"):
                for m in ("greedy", "avg@2", "pass@1", "pass@2"):
                    assert 0.0 <= rec[f"{who}/{s}/{m}"] <= 1.0
                assert rec[f"{who}/{s}/pass@2"] >= rec[f"{who}/{s}/pass@1"]
                assert rec[f"{who}/{s}/pass@1"] == pytest.approx(rec[f"{who}/{s}/avg@2"])
            for m in ("greedy", "avg@2", "pass@2"):
                assert rec[f"{who}/mean/{m}"] == pytest.approx(
                    (rec[f"{who}/synthetic/{m}"] + rec[f"{who}/amc23/{m}"]) / 2)
        for key in [k for k in rec if k.startswith("eval/")]:
            gap = key.replace("eval/", "eval_gap/", 1)
            assert rec[gap] == pytest.approx(rec[key] - rec[key.replace("eval/", "eval_fp/", 1)])
        assert rec["accuracy"] == rec["eval/mean/greedy"] and rec["n"] == 6
    # `qurl eval` scores the checkpoint as training's last evaluation did; --set overrides apply
    again = eval_run(runs_root / "ev", sets=["eval.pass_k=2"])
    assert "eval/mean/pass@1" not in again
    last = {k: v for k, v in recs[-1].items() if "pass@1" not in k and not k.startswith("time/")}
    assert {k: v for k, v in again.items() if not k.startswith("time/")} == pytest.approx(last)
