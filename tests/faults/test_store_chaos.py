"""The store backend under chaos, with real agents and Azurite behind a fault-injecting proxy: lost answers
after the write landed, throttling (503 ServerBusy with Retry-After, which is honoured), latency, odd records,
a 50 MB listing answer. What is asserted is what an operator notices: one StartRequests POST per event, never
before every VM's hook ended, the fleet still approving, a bounded agent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from tests.azurite import Azurite, azurite  # noqa: F401 - the fixture
from tests.store_chaos import (
    ODD,
    TAKEOVER,
    Fleet,
    big_listing,
    latency,
    lost_answers,
    no_fault,
    odd_record,
    start_fleet,
    throttled,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def fleet(start_emulator, start_agent, tmp_path: Path, azurite: Azurite) -> Iterator[Fleet]:
    """Three agents (hooks of 0.3, 0.6 and 1 s) on a new container, each through its own proxy."""
    started = start_fleet(start_emulator, start_agent, tmp_path, azurite, (0.3, 0.6, 1.0))
    yield started
    started.stop()


def test_an_event_without_faults_costs_a_few_requests_and_no_false_alarm(fleet: Fleet) -> None:
    """The baseline: one POST after the last hook, at most 10 store requests per VM over the event and the
    8 s after it, and no VM takes its own marker for a forged one (an Error that holds the fleet gate)."""
    result = no_fault(fleet)
    assert (result.approvals, result.early) == (1, 0), result
    assert result.figures["marker_forged_lines"] == 0, result
    assert result.figures["requests_per_vm_max"] <= 10, result


def test_lost_answers_after_the_write_landed_cost_one_post_in_all(fleet: Fleet) -> None:
    """The first answer to each VM's marker write, listing, claim and outcome record is lost after the
    write landed: the fleet still approves once, after the last hook."""
    result = lost_answers(fleet)
    assert result.figures["answers_lost"] >= 2 * len(fleet.vms) + 2, result  # markers, lists, claim, outcome
    assert (result.approvals, result.early) == (1, 0), result


def test_throttling_is_honoured_and_the_fleet_still_approves_once(fleet: Fleet) -> None:
    """503 ServerBusy with Retry-After: 3 on listings, marker writes and the claim: no VM asks that path again
    before the 3 s are up, and the one POST still goes out after the last hook."""
    result = throttled(fleet)
    assert result.figures["throttled"] >= 2 * len(fleet.vms), result
    assert result.figures["before_retry_after"] == 0, result.figures["examples"]
    assert (result.approvals, result.early) == (1, 0), result


def test_latency_on_every_store_request_never_holds_the_imds_poll(fleet: Fleet) -> None:
    """Every store request takes 0.5 s (a claim, its confirming read and the POST fit in half of the 4 s
    takeover_after): one POST after the last hook, and each VM's IMDS polls keep going."""
    result = latency(fleet, delay=0.5)
    assert (result.approvals, result.early) == (1, 0), result
    assert result.figures["poll_gap_max_s"] < 2.0, result


@pytest.mark.parametrize("kind", ODD)
def test_an_odd_record_never_stops_the_fleet(fleet: Fleet, kind: str) -> None:
    """An approval record with an empty attempt (it stays) is taken over once takeover_after old; a marker
    listed without Last-Modified, or with None in its fields and no ETag, is a problem, not a stuck event:
    in each case one POST, after the last hook, well within a minute."""
    result = odd_record(fleet, kind)
    assert (result.approvals, result.early) == (1, 0), result
    # the store's Date and Last-Modified have whole seconds: an age is up to 1 s short
    assert result.figures["after_record_s"] >= (TAKEOVER - 1 if kind == "empty attempt" else 0), result


def test_a_50_mb_listing_answer_costs_bounded_memory_and_log(start_emulator, start_agent, tmp_path: Path,
                                                             azurite: Azurite) -> None:
    """A VM alone in its event gets a listing answer padded to 50 MB of blobs the protocol did not write: its RSS
    stays within 100 MB of what it was, it logs a summary (not a line per blob), its polls go on, and its one
    POST goes out."""
    fleet = start_fleet(start_emulator, start_agent, tmp_path, azurite, (0.3,))
    try:
        result = big_listing(fleet)
    finally:
        fleet.stop()
    figures = result.figures
    assert "exited" not in figures, result
    assert figures["rss_peak_mb"] - figures["rss_before_mb"] < 100, result
    assert figures["invalid_record_lines"] <= 10 and figures["log_bytes"] < 1 << 20, result
    assert figures["poll_gap_max_s"] < 2.0, result
    assert (result.approvals, result.early) == (1, 0), result
