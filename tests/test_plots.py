"""The ablation figure's legend: an arm with fewer seeds than the study names them."""
from __future__ import annotations

from qurl.research.studies.plots import arm_label


def test_an_arm_with_every_seed_keeps_its_name():
    assert arm_label("bf16-ppo", [2, 0, 1], [0, 1, 2]) == "bf16-ppo"


def test_an_arm_with_fewer_seeds_lists_them_in_order():
    assert arm_label("fp8-acr-uaq", [1, 0], [0, 1, 2]) == "fp8-acr-uaq (seeds 0, 1)"
    assert arm_label("int8-geomask", [0], [0, 1, 2]) == "int8-geomask (seed 0)"


def test_the_report_draws_the_moe_routing_panel(tmp_path):
    from qurl.train.plots import PANELS, plot_runs, series

    keys = dict(PANELS)["MoE routes: learner vs engine"]
    recs = [{"kind": "train", "step": s, **{k: 0.1 / s for k in keys}} for s in (1, 2)]
    assert series(recs, "moe/route_flip_frac") == ([1, 2], [0.1, 0.05])
    assert plot_runs({"r": recs}, tmp_path / "p.png").stat().st_size > 0
