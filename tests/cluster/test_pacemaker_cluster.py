"""The `pacemaker` handler on a real two-node cluster (issue 37's scenarios), judged by what an operator
sees: where the resource runs (sampled every 0.2 s), who is in standby, and the StartRequests POSTs each
node's IMDS received."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import Rig
from tests.cluster.rig import Sampler
from tests.e2e.harness import wait_until

pytestmark = pytest.mark.cluster


def _settled(rig: Rig) -> str:
    """Both nodes online, none in standby, the resource running: the node it runs on."""
    mon = rig.cluster.wait(lambda m: m is not None and m.where("dummy") is not None
                           and all(v.online and not v.standby for v in m.nodes.values()), 60, "a settled cluster")
    where = mon.where("dummy")
    assert where is not None
    return where


def _posts(rig: Rig, vm: str, eid: str) -> list[float]:
    return [a.monotonic for a in rig.imds.approvals(vm) if eid in a.event_ids]


def test_one_event_moves_the_resource_then_posts_then_brings_the_node_back(rig: Rig) -> None:
    here = _settled(rig)
    there = rig.other(here)
    with Sampler(rig.cluster) as s:
        t0 = time.monotonic()
        eid = rig.imds.add_event("Reboot", [here], notice=300)
        wait_until(lambda: _posts(rig, here, eid), 60, "the POST")
        post = _posts(rig, here, eid)[0]
        gone = wait_until(lambda: rig.imds.when("emulator.event_completed", eid), 30, "the event to end")
        back = wait_until(lambda: s.first(lambda x: here not in x.standby and here in x.online, after=gone),
                          30, f"{here} back")
    moved = s.first(lambda x: x.where == there, after=t0)
    assert moved is not None and moved < post, "the resource moved before the POST"
    assert post - moved <= 1.0 + 0.2, f"the POST came {post - moved:.2f}s after the move"  # one sample's slack
    assert back - gone <= 2.0 + 0.2, f"{here} back {back - gone:.2f}s after the event ended"
    assert len(_posts(rig, here, eid)) == 1
    assert [x for x in s.samples if len(x.standby) > 1] == []
