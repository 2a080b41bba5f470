"""A weight sync across two network namespaces whose veth link is cut mid-sync (issue 60 item 5).

The learner's sender (rank 0) is this process, moved into node 0; a bare engine receiver (a
WeightReceiver feeding qurl.research.bench.sync_delta's Sink, which validates every chunk before it
changes anything, as the local engine does) runs in node 1 (qurl/research/bench/sync_link.py). The link is
tc-limited to 50 Mbit/s so a 16 MiB full sync takes a few seconds, and goes down 1 s into one
for longer than the group's 4 s timeout. Checked: both sides fail while the link is still down
(not hang until it returns), the receiver still holds the version it had verified (digest), and
once the link is up a re-formed group's delta sync against that version verifies. Needs root and
iproute2 (skipped otherwise), like tests/test_two_nodes.py."""
from __future__ import annotations

import pytest
import torch

from qurl.research.bench import netns

TIMEOUT_S, CUT_AFTER_S, CUT_FOR_S = 4.0, 1.0, 7.0


@pytest.fixture
def pair():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    with netns.NodePair(tag="qcut") as p:
        yield p


def test_link_cut_mid_sync_keeps_the_verified_version_and_the_next_sync_succeeds(pair):
    from qurl.research.bench.sync_link import LinkPair, cut_during_sync

    g = torch.Generator().manual_seed(0)
    v0 = [(f"layers.{i}.weight", torch.randint(-127, 128, (1024, 1024), generator=g,
                                               dtype=torch.int8)) for i in range(16)]
    pair.shape("50mbit")
    netns.enter(pair.names[0])
    try:
        link = LinkPair(pair, bucket_bytes=1 << 20, timeout_s=TIMEOUT_S)
        try:
            out = cut_during_sync(link, v0, timeout_s=TIMEOUT_S, cut_after_s=CUT_AFTER_S,
                                  cut_for_s=CUT_FOR_S)
        finally:
            link.close()
    finally:
        netns.leave()
    print(out)
    assert out["sender"] != "completed before the cut", out
    assert out["receiver"] != "ok", out
    down_until = CUT_AFTER_S + CUT_FOR_S  # both gave up before the link came back
    assert out["sender_fail_s"] < down_until, out
    assert out["receiver_fail_s"] is None or out["receiver_fail_s"] < down_until, out
    assert out["kept"], "the receiver does not hold its last verified version after the cut"
    assert out["next_ok"], "the sync after the link came back did not verify"


@pytest.mark.parametrize("spec", ["10gbt", "1gbit,,100mbit", "1gbit:10"])
def test_a_bad_link_spec_is_one_line_and_exit_2(spec, capsys):
    """A mistyped rate, an empty entry or a delay without unit: the command prints one line
    naming --link and exits 2 (qurl.errors.InputError), not a traceback. No root needed: the
    spec is checked before any namespace is made."""
    from qurl.cli import main

    assert main(["bench", "sync", "--delta", "--link", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qurl: error: --link") and err.count("\n") == 1
