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
