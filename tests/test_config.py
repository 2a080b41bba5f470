"""Config tree: presets, TOML + --set overrides, validation naming the field, resume immutables,
documented and typed fields, and config.toml files written before the redesign."""
import dataclasses
from pathlib import Path

import pytest

from qurl.algo.loss import loss_options
from qurl.config import (DEPLOYMENT_SECTIONS, PRESETS, TRAINING_SECTIONS, Config, ConfigError,
                         field_doc, immutable_changes, leaves, load_config, override,
                         to_toml, toml_updates)
from qurl.config.compat import RENAMED

OLD = Path(__file__).parent / "old_configs"


def test_presets_validate_and_paper_numbers():
    for name in PRESETS:
        load_config(name)
    dapo = load_config("paper-dapo-7b")
    assert (dapo.algo.clip, dapo.optim.lr) == ((0.2, 0.28), 1e-6)
    assert dapo.algo.dynamic_sampling_rounds == 16 and dapo.algo.overlong == (4096, 1.0)
    assert dapo.algo.uaq_scale == 1.5 and dapo.algo.kl_coef == 0
    ds = load_config("paper-deepscaler-1.5b")
    assert ds.algo.kl_coef == 1e-3 and ds.rollout.group_size == 8 and ds.algo.loss == "acr"
    default = load_config()
    assert (default.rollout.precision, default.algo.loss, default.algo.uaq_scale) == ("int8", "acr", 1.5)
    assert default.algo.mini_batches >= 2


def test_set_overrides_are_typed():
    cfg = load_config(sets=["optim.lr=1e-3", "deploy.wandb=online", "sglang.urls=http://a:1,http://b:2"])
    assert cfg.optim.lr == 1e-3 and cfg.deploy.wandb == "online"
    assert cfg.sglang.urls == ("http://a:1", "http://b:2")


@pytest.mark.parametrize("pair,field", [
    ("algo.loss=foo", "algo.loss"), ("optim.lr=-1", "optim.lr"),
    ("algo.correction.cap=0.5", "algo.correction.cap"),
    ("optim.lr=abc", "optim.lr"), ("nosuch.x=1", "nosuch.x"), ("algo.nosuch=1", "algo.nosuch"),
    ("algo.mini_batches=3", "algo.mini_batches"), ("learner.dp=0", "learner.dp"),
    ("learner.dp=3", "learner.dp"), ("learner.ep=2", "learner.ep"),  # ep must divide dp (1) ("rollout.precision=fp8_block", "rollout.precision"),  # 16*8/2 = 64 rows per mini-batch do not split 3 ways
    ("deploy.wandb=yes", "deploy.wandb"), ("model.dtype=fp16", "model.dtype"),
    ("rollout.max_staleness=1", "rollout.max_staleness"),  # inline rollout is synchronous
    ("optim.adam=0.9,0.999", "optim.adam"), ("optim.adam=0.9,0.999,0", "optim.adam"),
    ("data.format=custom", "data.fields"),
    ("deploy.stream.key=short", "deploy.stream.key"), ("rollout.top_p=1.5", "rollout.top_p"),
    ("algo.correction.bounds=1.5,5", "algo.correction.bounds"),
    ("algo.correction.bounds=0.5", "algo.correction.bounds"),
    ("algo.correction.bounds=0,1.01", "algo.correction.bounds"),
    ("algo.correction.bounds=0.99,0.999", "algo.correction.bounds"),
    ("algo.correction.keep=g", "algo.correction.keep"), ("algo.correction=2", "algo.correction"),
    ("algo.correction.nosuch=1", "algo.correction.nosuch"), ("algo.clip.cap=1", "algo.clip"),
    ("algo.clip=0.2", "algo.clip"), ("algo.clip=0,0.2", "algo.clip"),
    ("algo.overlong=4096", "algo.overlong"), ("algo.overlong=10.5,1", "algo.overlong"),
    ("algo.dynamic_sampling_rounds=-1", "algo.dynamic_sampling_rounds"),
])
def test_bad_values_name_the_field(pair, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(sets=[pair])


def test_toml_round_trip(tmp_path):
    cfg = load_config("paper-dapo-7b", sets=["sglang.args=--mem-fraction-static,0.8"])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert override(Config(), toml_updates(path)) == cfg


def test_immutable_changes_named():
    a = load_config()
    b = override(a, {"learner.tp": 2, "optim.lr": 1e-5})
    changes = immutable_changes(a, b)
    assert len(changes) == 1 and changes[0].startswith("learner.tp")
    c = override(a, {"learner.dp": 2, "deploy.ranks.distributed_optimizer": True})
    assert [x.split(":")[0] for x in immutable_changes(a, c)] == ["learner.dp",
                                                                 "deploy.ranks.distributed_optimizer"]


def test_auto_threads_give_every_run_the_whole_node(monkeypatch):
    """deploy.torch_threads=0 (the default): the node's cores divided among the processes that
    compute at once. Sync: the learner ranks only. Async with η ≥ 1 (or several workers) on CPU:
    learner ranks + local workers. η = 0 and one worker alternate, so each may use every core."""
    import torch

    from qurl.node import placement

    def busy_processes(c, **kw):
        return placement.busy_processes(c.learner, c.rollout, c.deploy, **kw)

    def learner_threads(c):
        return placement.learner_threads(c.learner, c.rollout, c.deploy)

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    sync = load_config()
    assert sync.deploy.torch_threads == 0
    assert busy_processes(sync) == 1 and learner_threads(sync) == 8
    assert learner_threads(load_config(sets=["learner.tp=2"])) == 4  # TP=2 on this node
    multi = load_config(sets=["deploy.ranks.nnodes=2", "deploy.ranks.nproc_per_node=2", "learner.tp=4"])
    assert busy_processes(multi) == 2  # only this node's ranks share its cores
    a = ["deploy.rollout=workers", "rollout.max_staleness=1", "deploy.engines=3"]
    if not torch.cuda.is_available():
        assert busy_processes(load_config(sets=a)) == 4  # learner + 3 workers
        assert learner_threads(load_config(sets=a)) == 2
    assert busy_processes(load_config(sets=a), workers=False) == 1  # evaluation only
    eta0 = load_config(sets=["deploy.rollout=workers", "rollout.max_staleness=0"])
    assert busy_processes(eta0) == 1
    remote = load_config(sets=["deploy.rollout=external", "rollout.max_staleness=1", "deploy.engines=3"])
    assert busy_processes(remote) == 1  # workers on other machines
    assert learner_threads(load_config(sets=["deploy.torch_threads=3"] + a)) == 3  # explicit wins
    with pytest.raises(ConfigError, match="deploy.torch_threads=-1"):
        load_config(sets=["deploy.torch_threads=-1"])


def test_multi_node_default_ranks_share_only_their_node(monkeypatch):
    """The fix of issue 14: with deploy.ranks.nproc_per_node left at its default, a rank of a 2-node
    TP-8 learner shares its node's cores with the 3 other ranks there (not with 7, nor alone),
    the same count `qurl launch` plans its torchrun with."""
    from qurl.commands.launch_plan import plan
    from qurl.node.placement import learner_ranks_per_node, learner_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    cfg = load_config(sets=["deploy.ranks.nnodes=2", "learner.tp=8"])
    assert learner_ranks_per_node(cfg.learner, cfg.deploy.ranks) == 4
    assert learner_threads(cfg.learner, cfg.rollout, cfg.deploy) == 4
    learner = plan(cfg, [], nodes=["a", "b"], gpus_per_node=8)[0].commands[-1]
    assert "--nproc-per-node=4" in learner.argv
    with pytest.raises(ConfigError, match="deploy.ranks.nnodes=3"):
        bad = load_config(sets=["deploy.ranks.nnodes=3", "learner.tp=8"])
        learner_ranks_per_node(bad.learner, bad.deploy.ranks)


def test_every_field_is_documented_and_training_fields_are_few():
    cfg = Config()
    n_training = 0
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):  # a nested table too has its docstring
            assert field_doc(type(obj), f.name), f"{section.name}.{f.name} has no docstring"
        for dotted, cls, name, _ in leaves(obj, f"{section.name}."):
            assert field_doc(cls, name), f"{dotted} has no docstring"
            n_training += section.name in TRAINING_SECTIONS  # leaves: a table counts its fields
    assert set(TRAINING_SECTIONS) | set(DEPLOYMENT_SECTIONS) == {f.name for f in dataclasses.fields(cfg)}
    # 62 before issue 57 (issue 22's five correction fields, model.warmstart_checkpoint,
    # learner.recompute); the corrections' six fields became algo.correction's three leaves, and
    # eps_low/eps_high, dynamic_sampling/max_sample_rounds, overlong_buffer/overlong_penalty and
    # betas/adam_eps one field each; 56 with algo.routing_replay, the field issue 67 (item 4) names;
    # 57 with learner.ep (issue 67's expert parallelism)
    assert n_training <= 57


@pytest.mark.parametrize("old,new", [("rollout.num_workers=2", "deploy.engines"),
                                     ("model.preset=small", "model.base"),
                                     ("rollout.mode=async", "deploy.rollout")])
def test_old_names_on_the_command_line_name_the_new_field(old, new):
    with pytest.raises(ConfigError, match=f"renamed to {new}"):
        load_config(sets=[old])


def test_old_config_toml_files_still_read(tmp_path):
    """A run directory written before the redesign resumes: its config.toml maps to today's fields."""
    from qurl.checkpoint.rundir import read_config

    run = tmp_path / "old"
    run.mkdir()
    (run / "config.toml").write_text((OLD / "default.toml").read_text())
    assert read_config(run) == load_config()
    (run / "config.toml").write_text((OLD / "async_external.toml").read_text())
    cfg = read_config(run)
    assert (cfg.deploy.rollout, cfg.deploy.engines, cfg.rollout.max_staleness) == ("external", 2, 1)
    assert (cfg.deploy.wandb, cfg.deploy.torch_threads, cfg.model.base) == ("online", 2, "/models/qwen")
    assert (cfg.data.fields, cfg.optim.adam, cfg.deploy.host) == (("q", "a"), (0.8, 0.95, 1e-8),
                                                                "10.0.0.1")
    assert (cfg.deploy.sync.port, cfg.eval.max_new_tokens, cfg.sglang.tp) == (29600, 48, 2)
    assert cfg.deploy.ranks.nproc_per_node == 0  # the old default 1 meant "tp*dp/nnodes"
    bad = (OLD / "async_external.toml").read_text().replace('host = "10.0.0.1"', 'host = "10.0.0.9"')
    (run / "config.toml").write_text(bad)
    with pytest.raises(ConfigError, match="learner.master_addr and stream.host differ"):
        read_config(run)


# What the loss code read from every preset before issue 57 nested the correction settings
# (loss_options of the resolved config, captured at b41a6bb), and the moved non-loss fields.
_USUAL_CORRECTION = {"tis_cap": 2.0, "seq_tis_cap": 2.0, "icepop_low": 0.5, "icepop_high": 5.0,
                     "icepop_keep": "rho", "geo_mask_low": 0.99, "geo_mask_high": 1.01,
                     "geo_mask_keep": "one"}
_PRESET_LOSS = {name: {"preset": "acr", "eps_low": 0.2, "eps_high": 0.2, "agg": "token-mean",
                       "kl_coef": 0.0, **_USUAL_CORRECTION} for name in PRESETS}
_PRESET_LOSS["paper-deepscaler-1.5b"]["kl_coef"] = 1e-3
_PRESET_LOSS["qwen3-30b-a3b"]["kl_coef"] = 1e-3  # added after issue 57: the 1.5B recipe's loss
_PRESET_LOSS["paper-dapo-7b"]["eps_high"] = 0.28


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_read_by_the_loss_are_unchanged_by_issue_57(name):
    cfg = load_config(name)
    assert loss_options(cfg.algo) == _PRESET_LOSS[name]
    dapo = name == "paper-dapo-7b"
    assert (cfg.algo.dynamic_sampling_rounds, cfg.algo.overlong) == \
        ((16, (4096, 1.0)) if dapo else (0, (0, 1.0)))
    assert cfg.optim.adam == (0.9, 0.999, 1e-8)


def test_flat_correction_names_read_into_the_nested_table(tmp_path):
    """A config.toml written before issue 57: every old name lands in its new field, the run
    resumes against the same config given with today's names, and it writes back unchanged."""
    from qurl.checkpoint.rundir import check_resume_config, read_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text((OLD / "before_issue57.toml").read_text())
    cfg = read_config(run)
    a = cfg.algo
    assert (a.loss, a.correction.bounds, a.correction.keep) == ("geomask", (0.9, 1.1), "geo")
    assert a.correction.cap == 2.0  # geomask's run: tis_cap's C (seq_tis_cap fed cut/seqtis only)
    assert (a.clip, a.dynamic_sampling_rounds, a.overlong) == ((0.2, 0.28), 8, (4, 0.5))
    assert cfg.optim.adam == (0.9, 0.95, 1e-6)
    kw = loss_options(a)
    assert (kw["geo_mask_low"], kw["geo_mask_high"], kw["geo_mask_keep"]) == (0.9, 1.1, "geo")
    assert (kw["eps_low"], kw["eps_high"]) == (0.2, 0.28)
    assert (kw["icepop_low"], kw["icepop_keep"]) == (0.5, "rho")  # the other mask: its usual
    today = load_config("smollm2-arith-sft", sets=[
        "run.name=int8-geomask", "algo.loss=geomask", "algo.uaq_scale=1.0", "eval.fp_policy=false",
        "algo.correction.bounds=0.9,1.1", "algo.correction.keep=geo", "algo.clip=0.2,0.28",
        "algo.dynamic_sampling_rounds=8", "algo.overlong=4,0.5", "optim.adam=0.9,0.95,1e-6"])
    check_resume_config(cfg, today)
    path = tmp_path / "today.toml"
    path.write_text(to_toml(cfg))
    assert "[algo.correction]" in path.read_text() and override(Config(), toml_updates(path)) == cfg


@pytest.mark.parametrize("loss,old,new", [
    # a value equal to the named kind's usual one is written as the default leaf
    ("icepop", {"algo.icepop_bounds": [0.5, 5.0], "algo.icepop_keep": "rho"}, ((), "auto")),
    ("icepop", {"algo.icepop_bounds": [0.4, 3], "algo.icepop_keep": "one",
                "algo.geo_mask_bounds": [0.9, 1.1]}, ((0.4, 3.0), "one")),
    ("geomask", {"algo.geo_mask_bounds": [0.99, 1.01], "algo.icepop_bounds": [0.4, 3]},
     ((), "auto")),
    # the bounds of a kind the run did not train with fed only its cut/ diagnostic
    ("acr", {"algo.icepop_bounds": [0.4, 3], "algo.geo_mask_keep": "rho"}, ((), "auto")),
])
def test_old_mask_settings_follow_the_loss(loss, old, new):
    from qurl.config.compat import upgrade

    flat = upgrade({"algo.loss": loss, **old}, where="test")
    cfg = override(Config(), flat)
    assert (cfg.algo.correction.bounds, cfg.algo.correction.keep) == new


def test_old_caps_merge_into_one():
    from qurl.config.compat import upgrade

    for loss, cap in (("seqtis", 5.0), ("mis", 3.0), ("acr", 3.0)):
        flat = upgrade({"algo.loss": loss, "algo.tis_cap": 3.0, "algo.seq_tis_cap": 5.0}, where="t")
        assert flat["algo.correction.cap"] == cap


@pytest.mark.parametrize("old", sorted(k for k, v in RENAMED.items()
                                       if v.startswith(("algo.", "optim.adam"))))
def test_issue_57_names_on_the_command_line_name_the_new_field(old):
    with pytest.raises(ConfigError, match=f"{old}: renamed to {RENAMED[old]}"):
        load_config(sets=[f"{old}=1"])


def test_dropped_field_is_skipped_on_read_and_refused_on_the_command_line():
    with pytest.raises(ConfigError, match="eval.per_question: no longer a config field"):
        load_config(sets=["eval.per_question=true"])
    # before_issue57.toml holds eval.per_question = true: read_config above skips it


def test_nested_leaves_round_trip_through_toml(tmp_path):
    cfg = load_config(sets=["algo.loss=icepop", "algo.correction.cap=3",
                            "algo.correction.bounds=0.4,2", "algo.correction.keep=one"])
    text = to_toml(cfg)
    assert 'bounds = [0.4, 2.0]\nkeep = "one"' in text
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert override(Config(), toml_updates(path)) == cfg
    assert [d for d, *_ in leaves(cfg.algo, "algo.")][:4] == [
        "algo.loss", "algo.clip", "algo.correction.cap", "algo.correction.bounds"]


def test_every_field_is_named_on_the_config_page():
    """docs/config.md is where a user looks a field up: every field of every section is on it."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "config.md").read_text()
    missing = [f"{section.name}.{f.name}" for section in dataclasses.fields(Config())
               for f in dataclasses.fields(getattr(Config(), section.name))
               if f"`{f.name}`" not in page]
    assert missing == []
