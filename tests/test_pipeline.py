"""The asynchronous pipeline end to end: real worker processes, real ZeroMQ on 127.0.0.1, gloo.

- η = 0 reproduces the synchronous loop's metrics for the same seed;
- η = 1 with two workers overlaps generation and training: tokens trained one version stale show up
  in the split diagnostics, nothing is staler than η, every prompt of the epoch is trained once;
- a stray peer's forged / truncated / oversized / replayed messages are rejected and counted while
  the run goes on undisturbed.
Plus fast unit tests of the ledger and of the run-key file.
"""
from __future__ import annotations

import math
import os
import stat
import threading
import time

import pytest
import torch
import zmq
from pipeline_helpers import (TIMING, assert_each_prompt_once, tiny_cfg, trained_uids,
                              use_free_dist_port)

from qurl.pipeline.ledger import Ledger, split_key
from qurl.pipeline.session import load_or_create_key, read_key, read_session
from qurl.pipeline.payload import pack_trajectories
from qurl.pipeline.frames import encode
from qurl.train.metrics_log import read_metrics
from qurl.types import Trajectory

# ---------------------------------------------------------------- fast: ledger, key file


def test_ledger_life_cycle_and_state_round_trip():
    led = Ledger()
    a = led.dispatch(5, "arith:1+2", slot=0, version=3)
    b = led.dispatch(7, "arith:3+4", slot=1, version=3)
    c = led.dispatch(5, "arith:1+2", slot=1, version=4)  # same prompt again: a distinct key
    assert (a.did, b.did, c.did) == (0, 1, 2) and a.key != c.key
    assert split_key(c.key) == ("arith:1+2", 2)
    assert led.complete(a.key) == a and led.buffered(a.key) == a and led.in_flight(a.key) is None
    assert [d.key for d in led.take_slot(1)] == [b.key, c.key]  # slot 1 died: both come back
    assert led.num_in_flight == 0
    d = led.dispatch(9, "arith:5+6", slot=0, version=5)
    state = led.state_dict()
    other = Ledger()
    other.load_state_dict(state)
    assert other.next_did == 4 and other.buffered(a.key) == a and other.in_flight(d.key) == d
    assert [x.index for x in other.take_in_flight()] == [9]
    assert [x.uid for x in other.trained([a.key])] == ["arith:1+2"]
    with pytest.raises(ValueError, match="dispatch key"):
        split_key("no-did")
    bad = dict(state, next_did=1)
    with pytest.raises(ValueError, match="next_did"):
        Ledger().load_state_dict(bad)


def test_run_key_is_private_and_kept(tmp_path):
    key = load_or_create_key(tmp_path)
    assert len(key) == 32
    assert stat.S_IMODE(os.stat(tmp_path / "stream.key").st_mode) == 0o600
    assert load_or_create_key(tmp_path) == key == read_key(tmp_path)  # a resume reuses it
    with pytest.raises(ValueError, match="at least 16"):
        load_or_create_key(tmp_path, "short")


def _group(key: str, n: int, version: int) -> list[Trajectory]:
    return [Trajectory(prompt_uid=key, sample_idx=j, prompt_ids=torch.tensor([1, 2]),
                       response_ids=torch.tensor([3, 4]), behav_logp=torch.tensor([-1.0, -1.0]),
                       versions=torch.tensor([version, version]), reward=float(j % 2),
                       finish_reason="stop") for j in range(n)]


def test_dispatcher_loses_and_repeats_nothing_through_deaths_staleness_and_resume():
    """A simulated η=1 run with two workers: one dies holding prompts, one group arrives too stale,
    a late duplicate arrives, and the controller restarts from a checkpoint mid-run. Every prompt
    is still trained exactly once, and the AReaL bound holds after every dispatch."""
    from qurl.data.datasets import Example
    from qurl.pipeline.dispatch import Dispatcher
    from qurl.types import SamplingParams

    B, G, eta, steps = 4, 2, 1, 6
    data = [Example(uid=f"q{i}", prompt=f"{i}+{i}", answer=str(2 * i)) for i in range(B * steps)]

    def new() -> Dispatcher:
        return Dispatcher(data, batch_size=B, group_size=G, max_staleness=eta, total_steps=steps,
                          seed=3, encode=lambda s: [5] * len(s), params=SamplingParams())

    work, queues = new(), {0: [], 1: []}

    def send(slot, meta, tensors):
        assert tensors["prompt_ids"].tolist() == [5] * 3 or tensors["prompt_ids"].numel() > 0
        queues[slot].append((meta["key"], meta["version"]))
        return True

    trained, late_key, version, events = [], None, 0, set()
    for _ in range(100):  # a bounded loop: every pass either trains or handles an event
        if version == steps:
            break
        work.dispatch(version, [0, 1], send)
        st = work.staleness
        assert st.accepted + st.running <= (eta + version + 1) * B
        if version == 1 and queues[1] and "death" not in events:  # worker 1 dies holding prompts
            events.add("death")
            late_key = queues[1][0][0]
            queues[1].clear()
            assert work.reclaim(1) > 0
            continue
        if version == 3 and "resume" not in events:  # checkpoint with prompts in flight; restart
            events.add("resume")
            work.accept(_group(late_key, G, 1), version)  # the dead worker's output, after all
            assert work.ledger.stats["late"] == G
            held = [k for q in queues.values() for k, _ in q]
            state = work.state_dict()
            work = new()
            assert held and work.load_state_dict(state, version) == len(held)
            for key in held:  # the old controller's workers answer anyway: late here
                work.accept(_group(key, G, version), version)
            assert work.ledger.stats["late"] == G * (1 + len(held))
            queues = {0: [], 1: []}
            continue
        if version == 2 and queues[0] and "stale" not in events:  # sampled 2 versions ago
            events.add("stale")
            key, _ = queues[0].pop(0)
            work.accept(_group(key, G, version - 2), version)
            assert work.ledger.stats["dropped_stale"] == 1
        for slot in (0, 1):  # every worker answers what it holds, sampled at dispatch version
            for key, v in queues[slot]:
                work.accept(_group(key, G, v), version)
            queues[slot].clear()
        popped = work.pop_batch(version)
        if popped is not None:
            groups, dispatches = popped
            assert [d.did for d in dispatches] == sorted(d.did for d in dispatches)
            assert all(version - int(t.versions.min()) <= eta for g in groups for t in g)
            trained += [d.uid for d in dispatches]
            version += 1
    assert events == {"death", "stale", "resume"} and version == steps
    assert sorted(trained) == sorted(ex.uid for ex in data)
    assert work.ledger.num_in_flight == 0 and work.ledger.num_buffered == 0


# ---------------------------------------------------------------- slow: real processes


@pytest.fixture(scope="module")
def run_root(runs_dir):
    """One directory for every run of this module; the warm-started base model comes from the
    session's shared cache (conftest.runs_dir)."""
    use_free_dist_port()
    return runs_dir("pipeline")


def _comparable(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not any(t in k for t in TIMING)}


@pytest.mark.slow
def test_eta0_async_reproduces_sync(run_root):
    from qurl.commands.train import train

    steps = 3
    train(tiny_cfg(run_root, "sync", steps))
    train(tiny_cfg(run_root, "async0", steps, **{"deploy.rollout": "workers"}))
    sync = read_metrics(run_root / "sync" / "metrics.jsonl")
    asyn = read_metrics(run_root / "async0" / "metrics.jsonl")
    assert [r["kind"] for r in sync] == [r["kind"] for r in asyn]
    for rs, ra in zip(sync, asyn):
        ra = _comparable(ra)
        for k, v in _comparable(rs).items():
            assert k in ra, (rs["step"], k)
            if isinstance(v, float):
                # same tokens, same log-probs, same update: only float noise of another process
                assert math.isclose(v, ra[k], rel_tol=1e-4, abs_tol=1e-6), (rs["step"], k, v, ra[k])
            else:
                assert v == ra[k], (rs["step"], k, v, ra[k])
    train_recs = [r for r in asyn if r["kind"] == "train"]
    # not vacuous: some samples were right, the policy moved, the 8-bit codes flipped
    assert any(r["reward"] > 0 for r in train_recs) and any(r["grad_norm"] > 0 for r in train_recs)
    assert any(r.get("flip_frac", 0) > 0 for r in train_recs)
    assert all(r["staleness_max"] == 0 for r in train_recs)
    # the engine's entropy crossed the stream with every trajectory (equal to sync's, above)
    assert all(r["behav_entropy"] > 0 for r in train_recs)
    assert train_recs[-1]["async/dispatched"] == steps * 4  # η = 0: never more than one batch out
    assert trained_uids(run_root / "async0") == [u for r in _trained_rows(run_root / "sync")
                                                 for u in r]


def _trained_rows(run_dir):
    """The sync loop's per-step prompt order: the data cursor's, reproduced from the config."""
    from qurl.checkpoint.rundir import read_config
    from qurl.data.cursor import DataCursor
    from qurl.data.splits import load_datasets

    cfg = read_config(run_dir)
    train_set, _ = load_datasets(cfg.data, cfg.run.seed)
    cur = DataCursor(len(train_set), seed=cfg.run.seed)
    return [[train_set[i].uid for i in cur.take(cfg.rollout.prompts_per_step)]
            for _ in range(cfg.run.steps)]


def _stray_peer(run_dir, stop: threading.Event, sent: dict) -> None:
    """Connect to the controller's inbound socket like a worker would and misbehave."""
    deadline = time.monotonic() + 300
    while not (run_dir / "controller.json").exists() or not (run_dir / "metrics.jsonl").exists():
        if stop.is_set() or time.monotonic() > deadline:
            return
        time.sleep(0.2)
    info = read_session(run_dir)
    key = read_key(run_dir)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(info["inbound"])
    t = Trajectory(prompt_uid="arith:1+1@999999", sample_idx=0,
                   prompt_ids=torch.tensor([5, 6, 7]), response_ids=torch.tensor([8, 9]),
                   behav_logp=torch.tensor([-0.5, -0.25]), versions=torch.tensor([0, 0]),
                   reward=1.0, finish_reason="stop")
    meta, tensors = pack_trajectories([t])
    meta["session"] = info["session"]
    good = encode("trajectory", meta, tensors, key=key, sender="stray:1:abcd", seq=0)
    forged = encode("trajectory", meta, tensors, key=b"not-the-run-key-at-all", sender="stray",
                    seq=0)
    msgs = {
        "bad_mac": forged,
        "truncated": good[:-2] + good[-1:],  # a tensor frame missing
        "oversized": [b"x"] * 100,  # more frames than any message may have
        "late": good,  # authentic, but for a dispatch nobody made: dropped by the ledger
        "replay": good,  # the very same frames again
    }
    for reason, frames in msgs.items():
        sock.send_multipart([bytes(f) for f in frames])
        sent[reason] = sent.get(reason, 0) + 1
        time.sleep(0.05)
    sock.close()
    ctx.term()


@pytest.mark.slow
def test_eta1_two_workers_stale_tokens_exactly_once_and_stray_peer(run_root):
    from qurl.commands.train import train

    cfg = tiny_cfg(run_root, "async1", 4, **{"deploy.rollout": "workers", "rollout.max_staleness": 1,
                                              "deploy.engines": 2})
    run_dir = run_root / "async1"
    stop, sent = threading.Event(), {}
    stray = threading.Thread(target=_stray_peer, args=(run_dir, stop, sent), daemon=True)
    stray.start()
    try:
        final = train(cfg)
    finally:
        stop.set()
        stray.join(30)
    recs = read_metrics(run_dir / "metrics.jsonl")
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4]
    assert 0.0 <= final["accuracy"] <= 1.0
    # generation ran ahead of training: one-version-stale tokens were trained, none staler than η
    assert any(r.get("tokens/s1", 0) > 0 for r in train_recs)
    assert max(r["staleness_max"] for r in train_recs) == 1
    assert all(math.isfinite(r["kl_behav_prox"]) for r in train_recs)
    assert all("sync/time_send" in r and "sync/time_quantize" in r for r in train_recs)
    assert_each_prompt_once(cfg, run_dir)
    # the stray peer sent one message of each kind; the last record has the counts
    assert sent == {"bad_mac": 1, "truncated": 1, "oversized": 1, "late": 1, "replay": 1}
    last = train_recs[-1]
    for reason in ("bad_mac", "truncated", "oversized", "replay"):
        assert last.get(f"async/rejects/{reason}") == 1.0, (reason, last)
    assert last.get("async/late") == 1.0


def test_dispatched_prompts_carry_the_answer_kind():
    """The async worker scores with the kind the prompt message carries: an arithmetic prompt must
    arrive as "number" (a boxed copy of the question scores 0), a MATH-style one as "math"."""
    from qurl.data.datasets import Example
    from qurl.data.synthetic import arithmetic_task
    from qurl.pipeline.dispatch import Dispatcher
    from qurl.types import SamplingParams

    data = arithmetic_task(2, seed=0, split="train", digits=1, n_operands=3) + \
        [Example("m0", "x", "\\frac{1}{2}"), Example("m1", "y", "3")]
    work = Dispatcher(data, batch_size=4, group_size=2, max_staleness=0, total_steps=1, seed=0,
                      encode=lambda s: [5] * len(s), params=SamplingParams())
    metas: list[dict] = []
    assert work.dispatch(0, [0], lambda slot, meta, tensors: metas.append(meta) or True) == 4
    kinds = {m["key"].split("@")[0]: (m["answer"], m["answer_kind"]) for m in metas}
    assert kinds == {ex.uid: (ex.answer, "number" if ex.uid.startswith("arith:") else "math")
                     for ex in data}
