"""Config tree: presets, TOML + --set overrides, validation naming the field, resume immutables."""
import pytest

from qurl.config import (PRESETS, ConfigError, Config, from_toml, immutable_changes, load_config,
                         override, to_toml)


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
    cfg = load_config(sets=["optim.lr=1e-3", "run.wandb=true", "rollout.sglang_urls=http://a:1,http://b:2"])
    assert cfg.optim.lr == 1e-3 and cfg.run.wandb is True
    assert cfg.rollout.sglang_urls == ("http://a:1", "http://b:2")


@pytest.mark.parametrize("pair,field", [
    ("algo.loss=foo", "algo.loss"), ("optim.lr=-1", "optim.lr"), ("algo.tis_cap=0.5", "algo.tis_cap"),
    ("optim.lr=abc", "optim.lr"), ("nosuch.x=1", "nosuch.x"), ("algo.nosuch=1", "algo.nosuch"),
    ("algo.mini_batches=3", "algo.mini_batches"), ("learner.dp=0", "learner.dp"),
    ("learner.dp=3", "learner.dp"), ("rollout.precision=fp8_block", "rollout.precision"),  # 16*8/2 = 64 rows per mini-batch do not split 3 ways
])
def test_bad_values_name_the_field(pair, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(sets=[pair])


def test_toml_round_trip(tmp_path):
    cfg = load_config("paper-dapo-7b", sets=["rollout.sglang_args=--mem-fraction-static,0.8"])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert from_toml(Config(), path) == cfg


def test_immutable_changes_named():
    a = load_config()
    b = override(a, {"learner.tp": 2, "optim.lr": 1e-5})
    changes = immutable_changes(a, b)
    assert len(changes) == 1 and changes[0].startswith("learner.tp")
    c = override(a, {"learner.dp": 2, "learner.distributed_optimizer": True})
    assert [x.split(":")[0] for x in immutable_changes(a, c)] == ["learner.dp",
                                                                 "learner.distributed_optimizer"]


def test_auto_threads_give_every_run_the_whole_node(monkeypatch):
    """run.torch_threads=0 (the default): the node's cores divided among the processes that
    compute at once. Sync: the learner ranks only. Async with η ≥ 1 (or several workers) on CPU:
    learner ranks + local workers. η = 0 and one worker alternate, so each may use every core."""
    import torch

    from qurl.setup import busy_processes, set_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    before = torch.get_num_threads()
    try:
        sync = load_config()
        assert sync.run.torch_threads == 0
        assert busy_processes(sync, 1) == 1 and set_threads(sync, 1) == 8 == torch.get_num_threads()
        assert set_threads(sync, busy_processes(sync, 2)) == 4  # TP=2 on this node
        multi = load_config(sets=["learner.nnodes=2", "learner.nproc_per_node=2", "learner.tp=4"])
        assert busy_processes(multi, 4) == 2  # only this node's ranks share its cores
        a = ["rollout.mode=async", "rollout.max_staleness=1", "rollout.num_workers=3"]
        if not torch.cuda.is_available():
            assert busy_processes(load_config(sets=a), 1) == 4  # learner + 3 workers
            assert set_threads(load_config(sets=a), 4) == 2
        assert busy_processes(load_config(sets=a), 1, workers=False) == 1  # evaluation only
        eta0 = load_config(sets=["rollout.mode=async", "rollout.max_staleness=0"])
        assert busy_processes(eta0, 1) == 1
        remote = load_config(sets=a + ["rollout.workers=external"])
        assert busy_processes(remote, 1) == 1  # workers on other machines
        assert set_threads(load_config(sets=["run.torch_threads=3"]), 4) == 3  # explicit wins
        with pytest.raises(ConfigError, match="run.torch_threads=-1"):
            load_config(sets=["run.torch_threads=-1"])
    finally:
        torch.set_num_threads(before)
