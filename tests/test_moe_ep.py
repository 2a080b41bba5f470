"""Expert parallelism (learner.ep, qurl/learner/expert_parallel.py): a tiny Qwen3-MoE learner at
DP 2 with EP 2 (each rank holds 4 of the 8 experts) against the same learner at DP 2 with EP 1,
real megatron-core MoE layers and its allgather token dispatcher on gloo, in one pair of spawned
processes (tests/spawn_in_turn.py).

What must hold, with the tolerance each check states:
- the learner's logits equal transformers' within 1e-4 (fp32; the TP tests' tolerance);
- two training steps (routing replay on, rows of different lengths on the two DP ranks, so the
  EP group must agree on its micro-batch widths) give EP 1's loss and grad norm within rel 1e-5
  and its weights within 1e-5 (lr 1e-3; the DP test's tolerances), with the distributed
  optimizer too;
- the weights the engines receive (`WeightSync`'s INT8 codes and scales, UAQ s=1.5) and the
  8-bit `qurl export` of a checkpoint written at EP 2 are bit-identical to EP 1's;
- a checkpoint written at EP 2 (one model file per EP rank) resumes bit-exactly;
- (the optimizer at DP 4 x EP 2, where expert-DP has 2 ranks, is tested with the other DP
  layouts in tests/test_learner.py, whose spawned job already has 4 ranks;)
- and, without processes: the agreed widths, the expert renumbering, and a bad learner.ep
  refused in one line.
"""
from __future__ import annotations

import pytest
import torch
from spawn_in_turn import spawn_in_turn

from qurl.config import AlgoConfig, LearnerConfig, ModelConfig, OptimConfig, RanksDeployConfig

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
ALGO = AlgoConfig(uaq_scale=1.5, loss="decoupled", mini_batches=2, routing_replay="rollout")
OPTIM = OptimConfig(lr=1e-3, grad_clip=0.01)  # the clip binds: the grad norm matters
LOGITS_TOL = 1e-4
WEIGHTS_TOL = 1e-5
B, S, P = 8, 14, 4  # rows, width, prompt tokens


def _batch(vocab: int, seed: int) -> tuple:
    """Rows ending at different places; in each mini-batch of 4 the first DP rank's 2 rows are
    longer than the second's, so each rank alone would pick other widths."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S), generator=g)
    mask = torch.zeros(B, S)
    for i, end in enumerate([14, 13, 9, 7, 12, 14, 8, 10]):
        mask[i, P:end] = 1.0
    behav = -0.5 * torch.rand(B, S, generator=g) * mask
    adv = torch.randn(B, generator=g)
    routes = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(B * S * 2)])
    return tokens, mask, behav, adv, routes.reshape(B, S, 2, 2)


def _worker(rank: int, ws: int, ep: int, distributed: bool, model_dir: str, where: str) -> dict:
    import json
    from pathlib import Path

    from qurl.checkpoint.rundir import CheckpointDir
    from qurl.commands.export import write_export
    from qurl.learner.dist import broadcast_object, init_learner_dist
    from qurl.learner.megatron import MegatronLearner
    from qurl.train.run_setup import OpenedRun
    from qurl.weights.publish import WeightSync

    lc = LearnerConfig(dp=2, ep=ep)
    init_learner_dist(lc, rank, ws)

    def make() -> MegatronLearner:
        return MegatronLearner(model_dir, ModelConfig(dtype="float32"), ALGO, OPTIM, lc,
                               total_steps=3, seed=0,
                               ranks=RanksDeployConfig(distributed_optimizer=distributed))

    def step(learner: MegatronLearner, batch: tuple) -> dict:
        tokens, mask, behav, adv, routes = batch
        return learner.train_step(tokens, mask, behav, adv, routes=routes)

    def weights(learner: MegatronLearner) -> dict:
        return {k: v.detach().cpu().clone() for k, v in learner.named_weights()}

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    root = Path(where) / f"ep{ep}-{'dist' if distributed else 'rep'}"
    ckpt0, ckpt1 = root / "ckpt0", root / "ckpt1"
    b1, b2 = _batch(vocab, 1), _batch(vocab, 2)
    a = make()
    out = {"logits": a.logits(b1[0]).cpu(), "initial": weights(a),
           "experts": len(a.model.decoder.layers[0].mlp.experts.local_experts)}
    a.save(ckpt0)
    out["stats1"] = step(a, b1)
    a.save(ckpt1)
    broadcast_object(None)  # every shard on disk
    out["stats2"], out["weights"] = step(a, b2), weights(a)
    out["files"] = sorted(p.name for p in ckpt1.iterdir())

    # the step-0 checkpoint, read back: what the engines receive, and its 8-bit export
    fresh = make()
    fresh.load(ckpt0)
    named = fresh.named_weights()
    if rank == 0:
        chunks, _ = WeightSync("int8").quantize(named)
        out["chunks"] = [(n, t.clone()) for n, t in chunks]
    else:
        for _ in named:
            pass
    opened = OpenedRun(root, CheckpointDir(root), model_dir, fresh, 0, None, rank == 0)
    out["export"] = write_export(opened, out=str(root / "export"), fmt="int8", dtype="bfloat16",
                                 uaq_scale=ALGO.uaq_scale)
    # resume after step 1: step 2 again
    fresh.load(ckpt1)
    out["resumed_stats2"], out["resumed_weights"] = step(fresh, b2), weights(fresh)
    if rank != 0:
        for k in ("logits", "initial", "weights", "resumed_weights"):
            out.pop(k)
    return out


LAYOUTS = [(1, False), (2, False), (2, True)]  # (learner.ep, distributed optimizer), DP 2 each


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from qurl.models.hf import build_model

    return build_model(tmp_path_factory.mktemp("moe-ep") / "m", "tiny-qwen3-moe", seed=3,
                       overrides=TINY)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir) -> dict[tuple, list[dict]]:
    where = tmp_path_factory.mktemp("ep-runs")
    return spawn_in_turn([(lay, 2, _worker, (*lay, str(model_dir), str(where))) for lay in LAYOUTS],
                         tmp_path_factory.mktemp("ep-meet"))


@pytest.mark.slow
def test_ep2_logits_match_transformers(runs, model_dir) -> None:
    from qurl.models.hf import load_checkpoint

    hf = load_checkpoint(model_dir, dtype=torch.float32)[0].eval()
    tokens = _batch(int(hf.config.vocab_size), 1)[0]
    with torch.no_grad():
        want = hf(tokens).logits
    for lay in LAYOUTS:
        got = runs[lay][0]
        assert got["experts"] == 8 // lay[0]  # each EP rank builds E/ep experts
        diff = float((got["logits"] - want).abs().max())
        assert diff <= LOGITS_TOL, (lay, diff)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_ep2_training_steps_equal_ep1(runs, layout) -> None:
    ref, got = runs[(1, False)][0], runs[layout]
    assert got[1]["stats1"] == got[0]["stats1"]  # every rank reports the same numbers
    for name in ("stats1", "stats2"):
        for key in ("loss", "grad_norm", "is_ratio_mean", "entropy", "moe/expert_load_max_over_mean",
                    "moe/route_flip_frac"):
            assert got[0][name][key] == pytest.approx(ref[name][key], rel=1e-5, abs=1e-9), (name, key)
    assert got[0]["stats1"]["grad_norm"] > OPTIM.grad_clip  # clipping bound: the norm matters
    assert list(got[0]["weights"]) == list(ref["weights"])  # every expert, ep 1's order
    for k, w in ref["weights"].items():
        torch.testing.assert_close(got[0]["weights"][k], w, rtol=0, atol=WEIGHTS_TOL, msg=k)
    moved = max(float((ref["initial"][k] - w).abs().max()) for k, w in ref["weights"].items())
    assert moved > 1e-4  # the steps did change the weights (lr 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_engines_receive_the_same_codes_and_the_export_is_the_same(runs, layout) -> None:
    from pathlib import Path

    from qurl.models.hf import read_state_dict

    ref, got = runs[(1, False)][0], runs[layout][0]
    assert [n for n, _ in got["chunks"]] == [n for n, _ in ref["chunks"]]
    assert any(t.dtype == torch.int8 for _, t in got["chunks"])
    for (n, t), (_, r) in zip(got["chunks"], ref["chunks"]):
        assert t.dtype == r.dtype and torch.equal(t, r), n
    mine, theirs = read_state_dict(Path(got["export"])), read_state_dict(Path(ref["export"]))
    assert sorted(mine) == sorted(theirs) and "model.layers.1.mlp.experts.7.up_proj.weight" in mine
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_ep2_checkpoint_resumes_exactly(runs, layout) -> None:
    for rank_out in runs[layout]:
        assert rank_out["resumed_stats2"] == rank_out["stats2"]
    got = runs[layout][0]
    assert all(torch.equal(got["resumed_weights"][k], w) for k, w in got["weights"].items())
    # one model file per EP rank (its 4 experts), an optimizer file per DP rank
    assert got["files"] == ["model_rank0_ep0.pt", "model_rank0_ep1.pt", "optim_rank0_dp0.pt",
                            "optim_rank0_dp1.pt"]


# ------------------------------------------------------------------ without processes


def test_the_ep_group_agrees_on_the_widest_rows() -> None:
    from qurl.learner.expert_parallel import ExpertParallel, plan_widths

    ep = ExpertParallel(rank=1, size=2, per_rank=4, peers=(0, 1))
    ends = torch.tensor([14, 13, 9, 7, 12, 14, 8, 10])
    peers = ep.peer_ends(ends, offset=4, share=2)  # the second mini-batch: rows 4-5 and 6-7
    assert peers.tolist() == [[12, 14], [8, 10]]
    assert plan_widths(peers).tolist() == [14, 12]  # sorted longest first, max over the ranks
    assert ExpertParallel().peer_ends(ends, 0, 4) is None  # no EP: each rank its own plan


def test_ep_shard_keeps_and_renumbers_its_experts() -> None:
    from qurl.models import moe

    p = "decoder.layers.1.mlp.experts.local_experts."
    shard = {f"{p}{e}.linear_fc1.weight": torch.full((1,), float(e)) for e in range(8)}
    shard["decoder.layers.1.mlp.router.weight"] = torch.zeros(8, 2)
    mine = moe.ep_shard(shard, 1, 2, 8)
    assert sorted(mine) == sorted([f"{p}{i}.linear_fc1.weight" for i in range(4)]
                                  + ["decoder.layers.1.mlp.router.weight"])
    assert [float(mine[f"{p}{i}.linear_fc1.weight"]) for i in range(4)] == [4.0, 5.0, 6.0, 7.0]
    with pytest.raises(ValueError, match="must divide the 8 experts"):
        moe.ep_shard(shard, 0, 3, 8)


@pytest.mark.parametrize("sets,named", [
    (["model.base=tiny-qwen3-moe", "learner.dp=2", "learner.ep=4"], "must divide learner.dp=2"),
    (["model.base=tiny", "learner.dp=2", "learner.ep=2"], "is a dense model"),
    (["model.base=tiny-qwen3-moe", "learner.dp=6", "learner.ep=3", "rollout.prompts_per_step=12"],
     "must divide the 8 experts"),
])
def test_a_bad_learner_ep_is_refused_in_one_line(tmp_path, capsys, sets, named) -> None:
    """ep must divide dp (a config rule) and the model's experts, and a dense model takes
    only 1 (qurl/models/fits.py): `qurl train` says so in one line, exit 2, before any rank."""
    from qurl.cli import main

    argv = ["train", "--set", f"deploy.dir={tmp_path / 'runs'}"]
    for s in sets:
        argv += ["--set", s]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "learner.ep=" in err[0] and named in err[0], err[0]
    assert not (tmp_path / "runs").exists()
