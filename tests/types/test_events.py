"""Parsing Scheduled Events documents of every API version, tolerantly."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.model.events import (
    MAX_DESCRIPTION,
    MAX_EVENTS,
    MAX_RESOURCES,
    DocumentError,
    parse_document,
    parse_event,
    parse_not_before,
)

FULL = {
    "DocumentIncarnation": 2,
    "Events": [{
        "EventId": "4CAEA225-A741-474D-A72E-428C86FCD853", "EventStatus": "Scheduled", "EventType": "Freeze",
        "ResourceType": "VirtualMachine", "Resources": ["WestNO_0", "WestNO_1"],
        "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
        "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
        "EventSource": "Platform", "DurationInSeconds": 5,
    }],
}


def test_every_field_of_a_2020_07_01_event_is_read():
    """All nine documented fields land in the Event, NotBefore as an aware UTC datetime."""
    doc = parse_document(FULL)
    (e,) = doc.events
    assert doc.incarnation == 2
    assert (e.event_id, e.event_type, e.status) == ("4CAEA225-A741-474D-A72E-428C86FCD853", "Freeze", "Scheduled")
    assert e.resources == ("WestNO_0", "WestNO_1")
    assert e.not_before == datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC)
    assert (e.source, e.duration_seconds, e.resource_type) == ("Platform", 5, "VirtualMachine")
    assert e.live_migration


def test_a_2017_03_01_event_without_later_fields_gets_documented_defaults():
    """Old API versions omit Description, EventSource and DurationInSeconds: defaults fill them in."""
    doc = parse_document({"DocumentIncarnation": 5, "Events": [{
        "EventId": "a", "EventStatus": "Scheduled", "EventType": "Reboot", "ResourceType": "VirtualMachine",
        "Resources": ["_myvm"], "NotBefore": "Wed, 24 Jan 2018 21:20:44 GMT"}]})
    (e,) = doc.events
    assert (e.description, e.source, e.duration_seconds) == ("", "Platform", -1)


def test_unknown_event_type_and_status_are_kept_as_text():
    """A future EventType (e.g. an OS-image upgrade) is kept, not dropped, and labelled Other in metrics."""
    doc = parse_document({"Events": [{"EventId": "x", "EventType": "OSUpgrade", "EventStatus": "Pending"}]})
    (e,) = doc.events
    assert (e.event_type, e.status, e.type_label) == ("OSUpgrade", "Pending", "Other")


@pytest.mark.parametrize("raw,expected", [
    ("Thu, 16 Mar 2023 14:01:28 GMT", datetime(2023, 3, 16, 14, 1, 28, tzinfo=UTC)),
    ("2016-09-19T18:29:47Z", datetime(2016, 9, 19, 18, 29, 47, tzinfo=UTC)),
    ("2026-04-29T18:00:00", datetime(2026, 4, 29, 18, 0, tzinfo=UTC)),
    ("", None), ("   ", None), ("next tuesday", None), (None, None), (12345, None),
])
def test_not_before_rfc1123_first_then_iso_and_blank_means_none(raw, expected):
    """NotBefore: RFC 1123 on the wire, ISO 8601 from some docs, "" once Started; garbage is no deadline."""
    assert parse_not_before(raw) == expected


def test_incarnation_as_string_is_accepted():
    """Some clients and samples send DocumentIncarnation as a string."""
    assert parse_document({"DocumentIncarnation": "7", "Events": []}).incarnation == 7
    assert parse_document({"DocumentIncarnation": "x", "Events": []}).incarnation is None


def test_malformed_event_is_skipped_with_its_reason_and_id():
    """An event without EventType is skipped, the rest kept, the skip names the field."""
    doc = parse_document({"Events": [
        {"EventId": "GOOD", "EventType": "Reboot", "EventStatus": "Scheduled"},
        {"EventId": "BAD", "EventStatus": "Scheduled"},
        "not an object",
        {"EventId": "R", "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": "vm1"},
    ]})
    assert [e.event_id for e in doc.events] == ["GOOD"]
    assert [(s.index, s.event_id) for s in doc.skipped] == [(1, "BAD"), (2, None), (3, "R")]
    assert "EventType" in doc.skipped[0].reason


@pytest.mark.parametrize("data", [None, [], "text", {"DocumentIncarnation": 1}, {"Events": {}}])
def test_a_document_without_an_events_list_is_malformed_as_a_whole(data):
    """Not an object with an Events list: DocumentError, so the poll counts as failed (not 'all gone')."""
    with pytest.raises(DocumentError):
        parse_document(data)


@pytest.mark.parametrize("vm,expected", [("vm1", True), ("VM1", True), ("vm10", False), ("vm", False), ("m1", False)])
def test_resources_match_is_exact_and_case_insensitive(vm, expected):
    """vm1 is not vm10: matching never uses substrings."""
    doc = parse_document({"Events": [{"EventId": "a", "EventType": "Reboot", "EventStatus": "Scheduled",
                                      "Resources": ["Vm1", "vm2"]}]})
    assert doc.events[0].names(vm) is expected


def test_rank_is_position_in_resources():
    """Rank = index of the VM in Resources, case-insensitive; None when absent."""
    doc = parse_document({"Events": [{"EventId": "a", "EventType": "Reboot", "EventStatus": "Scheduled",
                                      "Resources": ["a", "B", "c"]}]})
    assert [doc.events[0].rank(n) for n in ("A", "b", "c", "d")] == [0, 1, 2, None]


def test_live_migration_only_for_freeze_with_that_description():
    """Only a Freeze mentioning live migration is classified as one."""
    base = {"EventId": "a", "EventStatus": "Scheduled", "Description": "memory-preserving Live Migration"}
    assert parse_document({"Events": [{**base, "EventType": "Freeze"}]}).events[0].live_migration
    assert not parse_document({"Events": [{**base, "EventType": "Reboot"}]}).events[0].live_migration


def test_to_json_round_trips_through_the_parser():
    """The state store saves events as JSON and reads them back unchanged."""
    (e,) = parse_document(FULL).events
    (again,) = parse_document({"Events": [e.to_json()]}).events
    assert again == e


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
event_like = st.fixed_dictionaries({}, optional={
    "EventId": json_values | st.text(max_size=8), "EventType": json_values | st.sampled_from(["Reboot", "Freeze"]),
    "EventStatus": json_values | st.sampled_from(["Scheduled", "Started"]), "Resources": json_values,
    "NotBefore": json_values | st.just("Mon, 19 Sep 2016 18:29:47 GMT"), "DurationInSeconds": json_values,
    "Description": json_values, "EventSource": json_values, "ResourceType": json_values,
})


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, st.fixed_dictionaries({"DocumentIncarnation": json_values,
                                                      "Events": st.lists(event_like | json_values, max_size=5)})))
def test_any_json_parses_or_raises_document_error_only(data):
    """Whatever IMDS (or a proxy) sends, the parser never raises anything but DocumentError."""
    json.dumps(data, allow_nan=True)
    try:
        doc = parse_document(data)
    except DocumentError:
        return
    assert len(doc.events) + len(doc.skipped) == len(data["Events"])
    for e in doc.events:
        assert e.event_id and e.event_type and e.status
        assert e.not_before is None or e.not_before.tzinfo is not None


def _ev(eid: str, **fields):
    return {"EventId": eid, "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": ["vm1"],
            "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT", **fields}


def test_unchanged_events_are_reused_from_the_previous_document_and_changed_ones_parsed_again():
    """At 1 Hz most events come back as they were: those are the previous document's Events; an event
    whose status changed is parsed anew and shows the new status."""
    first = parse_document({"Events": [_ev("a"), _ev("b")]})
    second = parse_document({"Events": [_ev("a"), _ev("b", EventStatus="Started", NotBefore="")]}, first)
    assert second.events[0] is first.events[0]
    assert second.events[1].status == "Started" and second.events[1].not_before is None
    assert parse_document({"Events": [_ev("a"), _ev("b")]}) == first, "reuse never changes what a document says"


def test_what_is_kept_for_reuse_never_outgrows_one_document():
    """Only the previous document's events are kept: after many events came and went, the parser holds
    just the ones in the current document."""
    doc = None
    for i in range(200):
        doc = parse_document({"Events": [_ev(f"e{i}"), _ev(f"e{i + 1}")]}, doc)
    assert len(doc.parsed) == 2


def test_a_boolean_duration_is_not_mistaken_for_a_number_by_reuse():
    """true == 1 in Python; DurationInSeconds true is still no duration (-1), even right after a 1."""
    one = parse_document({"Events": [_ev("a", DurationInSeconds=1)]})
    assert parse_document({"Events": [_ev("a", DurationInSeconds=True)]}, one).events[0].duration_seconds == -1


def _event(**fields):
    return {"EventId": "E1", "EventType": "Reboot", "EventStatus": "Scheduled", **fields}


def test_a_huge_description_is_cut_with_a_marker_and_nul_characters_are_dropped():
    """A 20 MB Description must not become 20 MB log lines, state writes or hook environments; a NUL
    would make every exec hook fail; what was cut is said, and cutting again changes nothing."""
    (huge, nul) = parse_document({"Events": [_event(Description="x" * 20_000_000),
                                             _event(EventId="E2", Description="live\0 migration")]}).events
    assert len(huge.description) <= MAX_DESCRIPTION and huge.description.endswith("more characters]")
    assert parse_event(huge.to_json()).description == huge.description
    assert nul.description == "live migration"


@pytest.mark.parametrize("field, value", [("EventId", "E" * 129), ("EventId", "E\n1"), ("EventType", "R" * 129),
                                          ("EventStatus", "S\x00")])
def test_an_identifying_field_too_long_or_not_printable_skips_the_event(field, value):
    """EventId, EventType and EventStatus are short printable text or the event is skipped (and said why)."""
    doc = parse_document({"Events": [_event(**{field: value})]})
    assert doc.events == () and field in doc.skipped[0].reason
    assert doc.skipped[0].event_id in (None, "E1"), "an unusable EventId is never carried on"


def test_oversized_short_fields_fall_back_to_their_defaults():
    """ResourceType, EventSource and NotBefore that are absurdly long read as absent."""
    (e,) = parse_document({"Events": [_event(ResourceType="V" * 500, EventSource="P" * 500,
                                             NotBefore="Mon, 19 Sep 2016 18:29:47 GMT" + " " * 500)]}).events
    assert (e.resource_type, e.source, e.not_before, e.not_before_raw) == ("VirtualMachine", "Platform", None, "")


def test_resources_names_too_long_are_dropped_and_too_many_names_skip_the_event_by_id():
    """A name longer than any VM name is dropped; more than MAX_RESOURCES names skips the event, its
    EventId kept so the tracker keeps what it knew of it."""
    (e,) = parse_document({"Events": [_event(Resources=["vm1", "v" * 300, "vm\x002"])]}).events
    assert e.resources == ("vm1",)
    doc = parse_document({"Events": [_event(Resources=[f"vm{i}" for i in range(MAX_RESOURCES + 1)])]})
    assert doc.events == () and doc.skipped[0].event_id == "E1" and "Resources" in doc.skipped[0].reason


def test_a_document_with_more_events_than_any_vm_sees_is_malformed_as_a_whole():
    """Past MAX_EVENTS the document is refused (the poll fails) instead of logging every one."""
    with pytest.raises(DocumentError, match="events"):
        parse_document({"Events": [{}] * (MAX_EVENTS + 1)})
