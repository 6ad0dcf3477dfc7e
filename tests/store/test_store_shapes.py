"""Store records of any shape are problems, never exceptions: what a listing may hold (None values, missing fields,
no Last-Modified or ETag, odd types), the property over any shape, and what the loop does with a job that raised."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.coordination.store.store_protocol import (
    APPROVED,
    CLAIMED,
    READY,
    UNREADABLE,
    Item,
    approval_blob,
    approval_record,
    marker_blob,
    marker_record,
    next_step,
    parse_listing,
)
from tests.store.test_store_protocol import EVENT, NOW

VMS = ("web_a", "web_b", "web_c")


def ready_markers() -> list[Item]:
    return [Item(marker_blob(EVENT, v), marker_record(EVENT, v, READY), f"e-{v}", NOW) for v in VMS]


def approval(age: float = 61.0, etag: Any = "etag-1", last_modified: Any = "auto", **fields: Any) -> Item:
    written = NOW - timedelta(seconds=age) if last_modified == "auto" else last_modified
    return Item(approval_blob(EVENT), {**approval_record(EVENT, VMS[0], CLAIMED, 1), **fields}, etag, written)


@pytest.mark.parametrize("odd", [
    approval(attempt=None), approval(by=None), approval(state=None, kind=None), approval(attempt=7),
    approval(**{"x-extra": None}), Item(approval_blob(EVENT), {1: "1"}, "etag-1", NOW - timedelta(seconds=61)),
    Item(approval_blob(EVENT), None, "etag-1", NOW - timedelta(seconds=61)),  # type: ignore[arg-type]
    Item(approval_blob(EVENT), ["maintd"], "etag-1", NOW - timedelta(seconds=61)),  # type: ignore[arg-type]
    approval(attempt="\u0661\u0662"),  # Arabic-Indic digits: str.isdigit() says yes, int() agrees; not a count
    approval(attempt="9" * 5000),
])
def test_an_unreadable_approval_record_is_taken_over_after_takeover_after(odd: Item) -> None:
    """An `approval` blob whose metadata is None, a number, or missing: unreadable, a problem, and taken over with
    If-Match once takeover_after old (today: an exception, and no VM ever sends another request)."""
    seen = parse_listing(EVENT, [*ready_markers(), odd], NOW, VMS)
    assert seen.approval is not None and seen.approval.state == UNREADABLE
    assert seen.odd == 1 and seen.problems[0].startswith("approval record")
    step = next_step(seen, VMS, VMS[1], 60)
    assert (step.action, step.etag) == ("take_over", "etag-1")
    young = parse_listing(EVENT, [*ready_markers(), Item(odd.name, odd.metadata, odd.etag, NOW)], NOW, VMS)
    assert next_step(young, VMS, VMS[1], 60).action == "wait"


@pytest.mark.parametrize("odd, why", [
    (approval(last_modified=None), "Last-Modified"),
    (approval(last_modified=datetime(2026, 11, 25, 11, 0)), "Last-Modified"),  # naive: no zone, no age
    (approval(last_modified="Wed, 25 Nov 2026 11:00:00 GMT"), "Last-Modified"),
    (approval(etag=None), "ETag"),
    (approval(etag=b"etag-1", attempt=None), "ETag"),
])
def test_a_record_without_etag_or_last_modified_is_reported_and_never_taken_over(odd: Item, why: str) -> None:
    """Without a usable Last-Modified its age is unknown, without an ETag there is nothing to If-Match: a problem,
    and the VM waits (the next listing that shows both decides); never an exception, never a takeover."""
    seen = parse_listing(EVENT, [*ready_markers(), odd], NOW, VMS)
    assert seen.odd == 1 and why in seen.problems[0]
    assert next_step(seen, VMS, VMS[1], 60).action == "wait"


@pytest.mark.parametrize("odd", [
    Item(marker_blob(EVENT, "web_b"), {**marker_record(EVENT, "web_b", READY), "state": None}, "e", NOW),
    Item(marker_blob(EVENT, "web_b"), marker_record(EVENT, "web_b", READY), None, None),
    Item(marker_blob(EVENT, "web_b"), {"maintd": None}, "e", "yesterday"),  # type: ignore[arg-type]
    Item(None, marker_record(EVENT, "web_b", READY), "e", NOW),  # type: ignore[arg-type]
    Item(7, {}, 8, 9),  # type: ignore[arg-type]
])
def test_a_marker_of_any_shape_is_parsed_or_reported_never_raised_on(odd: Item) -> None:
    """A marker with a None state, no ETag or Last-Modified, a blob without a name: parsed (a marker with a valid
    record still counts, whatever the listing left out) or a problem; never a crash."""
    seen = parse_listing(EVENT, [ready_markers()[0], odd, ready_markers()[2]], NOW, VMS)
    readable = "web_b" in seen.markers
    assert readable == (seen.odd == 0)
    assert next_step(seen, VMS, VMS[0], 60).action == ("claim" if readable else "wait")


def test_a_junk_listing_is_one_summary_not_a_problem_per_blob() -> None:
    """80,000 junk blobs in an event's folder: counted, five described (today: 80,000 problems, one log line each)."""
    junk = [Item(f"events/{EVENT.lower()}/junk{i}", {}, "e", NOW) for i in range(80_000)]
    seen = parse_listing(EVENT, [*ready_markers(), *junk], NOW, VMS)
    assert seen.odd == 80_000 and len(seen.problems) == 5
    assert next_step(seen, VMS, VMS[0], 60).action == "claim"


TEXT = st.text(max_size=12)
HASHABLE = st.one_of(st.none(), TEXT, st.integers(), st.binary(max_size=4), st.floats(allow_nan=True))
ODD = st.one_of(HASHABLE, st.lists(TEXT, max_size=2))
FIELD = st.sampled_from(["maintd", "kind", "event", "vm", "by", "state", "attempt", "health", "MAINTD", "x"])
VALUE = st.one_of(ODD, st.sampled_from(["1", "vm", "approval", EVENT, EVENT.lower(), *VMS, READY, CLAIMED, APPROVED,
                                        "released", "preparing", "ok", "unhealthy", "0", "1", "3"]))
METADATA = st.one_of(ODD, st.dictionaries(st.one_of(FIELD, HASHABLE), VALUE, max_size=8))
NAME = st.one_of(ODD, st.sampled_from([approval_blob(EVENT), *(marker_blob(EVENT, v) for v in VMS),
                                       f"events/{EVENT.lower()}/vm/other", "elsewhere"]))
WHEN = st.one_of(ODD, st.datetimes(timezones=st.none() | st.just(UTC)))
ITEM = st.builds(Item, NAME, METADATA, st.one_of(ODD, TEXT), WHEN)


def _valid(metadata: object) -> bool:
    return isinstance(metadata, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())


@settings(max_examples=400, deadline=None)
@given(st.lists(ITEM, max_size=8), st.sampled_from(VMS), st.floats(min_value=1, max_value=600))
def test_any_listing_parses_and_never_invents_readiness_or_an_approval(items: list[Item], me: str,
                                                                       takeover_after: float) -> None:
    """Whatever the listing holds: a Listing and a Step, never an exception; a VM counts ready only from a marker
    whose every field is text and says ready; the event is done only by a record whose every field is text."""
    seen = parse_listing(EVENT, items, NOW, VMS)
    step = next_step(seen, VMS, me, takeover_after)
    assert step.action in ("wait", "claim", "take_over", "done")
    assert seen.odd >= len(seen.problems) and len(seen.problems) <= 5
    for vm, marker in seen.markers.items():
        assert any(i.name == marker_blob(EVENT, vm) and _valid(i.metadata) and i.metadata.get("state") == marker.state
                   for i in items)
    if step.action == "done":
        assert any(i.name == approval_blob(EVENT) and _valid(i.metadata) and i.metadata.get("state") == APPROVED
                   for i in items)
    if step.action in ("claim", "take_over"):
        assert all(seen.markers.get(v) is not None and seen.markers[v].state == READY for v in VMS)
    if step.action == "take_over":
        assert step.etag and isinstance(step.etag, str)

