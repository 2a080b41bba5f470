"""Config tree: presets, TOML + --set overrides, validation naming the field, resume immutables,
documented and typed fields, and config.toml files written before the redesign."""
import dataclasses
from pathlib import Path

import pytest

from qurl.config import (DEPLOYMENT_SECTIONS, PRESETS, TRAINING_SECTIONS, ConfigError, Config,
                         field_doc, from_toml, immutable_changes, load_config, override, to_toml)

OLD = Path(__file__).parent / "old_configs"


def test_presets_validate_and_paper_numbers():
    for name in PRESETS:
        load_config(name)
    dapo = load_config("paper-dapo-7b")
    assert (dapo.algo.eps_low, dapo.algo.eps_high, dapo.optim.lr) == (0.2, 0.28, 1e-6)
    assert dapo.algo.dynamic_sampling and dapo.algo.uaq_scale == 1.5 and dapo.algo.kl_coef == 0
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
    ("algo.loss=foo", "algo.loss"), ("optim.lr=-1", "optim.lr"), ("algo.tis_cap=0.5", "algo.tis_cap"),
    ("optim.lr=abc", "optim.lr"), ("nosuch.x=1", "nosuch.x"), ("algo.nosuch=1", "algo.nosuch"),
    ("algo.mini_batches=3", "algo.mini_batches"), ("learner.dp=0", "learner.dp"),
    ("learner.dp=3", "learner.dp"), ("rollout.precision=fp8_block", "rollout.precision"),  # 16*8/2 = 64 rows per mini-batch do not split 3 ways
    ("deploy.wandb=yes", "deploy.wandb"), ("model.dtype=fp16", "model.dtype"),
    ("rollout.max_staleness=1", "rollout.max_staleness"),  # inline rollout is synchronous
    ("optim.betas=0.9", "optim.betas"), ("data.format=custom", "data.fields"),
    ("deploy.stream_key=short", "deploy.stream_key"), ("rollout.top_p=1.5", "rollout.top_p"),
    ("algo.icepop_bounds=1.5,5", "algo.icepop_bounds"), ("algo.icepop_bounds=0.5", "algo.icepop_bounds"),
    ("algo.geo_mask_bounds=0,1.01", "algo.geo_mask_bounds"),
    ("algo.geo_mask_bounds=0.99,0.999", "algo.geo_mask_bounds"),
    ("algo.geo_mask_keep=g", "algo.geo_mask_keep"), ("algo.seq_tis_cap=0.9", "algo.seq_tis_cap"),
])
def test_bad_values_name_the_field(pair, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(sets=[pair])


def test_toml_round_trip(tmp_path):
    cfg = load_config("paper-dapo-7b", sets=["sglang.args=--mem-fraction-static,0.8"])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert from_toml(Config(), path) == cfg


def test_immutable_changes_named():
    a = load_config()
    b = override(a, {"learner.tp": 2, "optim.lr": 1e-5})
    changes = immutable_changes(a, b)
    assert len(changes) == 1 and changes[0].startswith("learner.tp")
    c = override(a, {"learner.dp": 2, "deploy.distributed_optimizer": True})
    assert [x.split(":")[0] for x in immutable_changes(a, c)] == ["learner.dp",
                                                                 "deploy.distributed_optimizer"]


def test_auto_threads_give_every_run_the_whole_node(monkeypatch):
    """deploy.torch_threads=0 (the default): the node's cores divided among the processes that
    compute at once. Sync: the learner ranks only. Async with η ≥ 1 (or several workers) on CPU:
    learner ranks + local workers. η = 0 and one worker alternate, so each may use every core."""
    import torch

    from qurl.deploy.placement import busy_processes, learner_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    sync = load_config()
    assert sync.deploy.torch_threads == 0
    assert busy_processes(sync) == 1 and learner_threads(sync) == 8
    assert learner_threads(load_config(sets=["learner.tp=2"])) == 4  # TP=2 on this node
    multi = load_config(sets=["deploy.nnodes=2", "deploy.nproc_per_node=2", "learner.tp=4"])
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
    """The fix of issue 14: with deploy.nproc_per_node left at its default, a rank of a 2-node
    TP-8 learner shares its node's cores with the 3 other ranks there (not with 7, nor alone),
    the same count `qurl launch` plans its torchrun with."""
    from qurl.deploy.launch import plan
    from qurl.deploy.placement import learner_ranks_per_node, learner_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    cfg = load_config(sets=["deploy.nnodes=2", "learner.tp=8"])
    assert learner_ranks_per_node(cfg) == 4 and learner_threads(cfg) == 4
    learner = plan(cfg, [], nodes=["a", "b"], gpus_per_node=8)[0].commands[-1]
    assert "--nproc-per-node=4" in learner.argv
    with pytest.raises(ConfigError, match="deploy.nnodes=3"):
        learner_ranks_per_node(load_config(sets=["deploy.nnodes=3", "learner.tp=8"]))


def test_every_field_is_documented_and_training_fields_are_few():
    cfg = Config()
    n_training = 0
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            assert field_doc(type(obj), f.name), f"{section.name}.{f.name} has no docstring"
        n_training += len(dataclasses.fields(obj)) if section.name in TRAINING_SECTIONS else 0
    assert set(TRAINING_SECTIONS) | set(DEPLOYMENT_SECTIONS) == {f.name for f in dataclasses.fields(cfg)}
    # 55 before issue 22's five correction fields (algo.icepop_bounds, ...); 61 with
    # model.warmstart_checkpoint (opt-in, or the tiny model's 250 default steps would fine-tune
    # every checkpoint given as model.base); 62 with learner.recompute (issue 56; the attention
    # kernel is deploy.attention: it changes no number)
    assert n_training <= 62


@pytest.mark.parametrize("old,new", [("rollout.num_workers=2", "deploy.engines"),
                                     ("model.preset=small", "model.base"),
                                     ("rollout.mode=async", "deploy.rollout")])
def test_old_names_on_the_command_line_name_the_new_field(old, new):
    with pytest.raises(ConfigError, match=f"renamed to {new}"):
        load_config(sets=[old])


def test_old_config_toml_files_still_read(tmp_path):
    """A run directory written before the redesign resumes: its config.toml maps to today's fields."""
    from qurl.train.rundir import read_config

    run = tmp_path / "old"
    run.mkdir()
    (run / "config.toml").write_text((OLD / "default.toml").read_text())
    assert read_config(run) == load_config()
    (run / "config.toml").write_text((OLD / "async_external.toml").read_text())
    cfg = read_config(run)
    assert (cfg.deploy.rollout, cfg.deploy.engines, cfg.rollout.max_staleness) == ("external", 2, 1)
    assert (cfg.deploy.wandb, cfg.deploy.torch_threads, cfg.model.base) == ("online", 2, "/models/qwen")
    assert (cfg.data.fields, cfg.optim.betas, cfg.deploy.host) == (("q", "a"), (0.8, 0.95), "10.0.0.1")
    assert (cfg.deploy.weight_port, cfg.eval.max_new_tokens, cfg.sglang.tp) == (29600, 48, 2)
    assert cfg.deploy.nproc_per_node == 0  # the old default 1 meant "tp*dp/nnodes"
    bad = (OLD / "async_external.toml").read_text().replace('host = "10.0.0.1"', 'host = "10.0.0.9"')
    (run / "config.toml").write_text(bad)
    with pytest.raises(ConfigError, match="learner.master_addr and stream.host differ"):
        read_config(run)
