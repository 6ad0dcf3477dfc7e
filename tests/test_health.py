"""The health store on the Service Fabric model, case by case."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.health import HealthReport, HealthState, HealthStore, ReservedSource, StaleReport, parse_report

W, E, OK = HealthState.WARNING, HealthState.ERROR, HealthState.OK


def rep(source="watchdog", prop="queue", state=E, seq=1, ttl=None, remove=False, description=""):
    return HealthReport(source, prop, state, description, ttl, remove, seq)


def test_a_report_whose_sequence_is_not_greater_is_stale(clock):
    store = HealthStore(clock)
    store.report(rep(seq=5))
    for seq in (5, 4):
        with pytest.raises(StaleReport, match="stale"):
            store.report(rep(seq=seq, state=OK))
    store.report(rep(seq=6, state=OK))
    assert store.aggregate() == OK


def test_expiry_removes_or_counts_as_error(clock):
    store = HealthStore(clock)
    store.report(rep(prop="gone", state=OK, ttl=30, remove=True))
    store.report(rep(prop="kept", state=OK, ttl=30, remove=False))
    assert store.aggregate() == OK
    clock.advance(31)
    events = {e.report.property: e for e in store.snapshot()}
    assert "gone" not in events
    assert events["kept"].is_expired and events["kept"].state == E
    assert store.aggregate() == E
    assert "expired" in store.unhealthy()[0]["Description"]


def test_system_sources_are_reserved_case_insensitively(clock):
    store = HealthStore(clock)
    for source in ("System.FM", "system.Hosting"):
        with pytest.raises(ReservedSource):
            store.report(rep(source=source))


def test_aggregate_is_the_worst_and_warning_counts_as_error_when_asked(clock):
    store = HealthStore(clock)
    store.report(rep(prop="a", state=OK))
    store.report(rep(prop="b", state=W))
    assert store.aggregate() == W
    assert store.aggregate(consider_warning_as_error=True) == E
    store.report(rep(source="imds", prop="poll", state=E))
    assert store.aggregate(sources=lambda s: s != "imds") == W, "the probe's fail_on filter"


def test_transition_timestamps_follow_service_fabric(clock):
    store = HealthStore(clock)
    store.report(rep(state=OK, seq=1))
    t_ok = clock.now()
    clock.advance(10)
    store.report(rep(state=E, seq=2))
    t_err = clock.now()
    clock.advance(10)
    store.report(rep(state=E, seq=3))
    body = store.to_json()["HealthEvents"][0]
    assert body["LastOkTransitionAt"] == t_err.isoformat().replace("+00:00", "Z"), "left Ok when Error came"
    assert body["LastErrorTransitionAt"] == t_err.isoformat().replace("+00:00", "Z"), "unchanged by a repeat"
    assert body["LastWarningTransitionAt"] is None
    assert t_ok < t_err


def test_own_reports_are_numbered_and_an_unchanged_one_is_left_alone(clock):
    store = HealthStore(clock)
    store.set("imds", "poll", OK, "polling")
    first = store.snapshot()[0]
    clock.advance(5)
    store.set("imds", "poll", OK, "polling")
    assert store.snapshot()[0].received_at == first.received_at
    store.set("imds", "poll", W, "3 polls failed")
    assert store.snapshot()[0].sequence_number > first.sequence_number
    store.remove("imds", "poll")
    assert store.snapshot() == []


def test_to_json_uses_service_fabric_field_names(clock):
    store = HealthStore(clock)
    store.report(rep(state=W, description="queue depth 12000", ttl=60))
    body = store.to_json()
    assert body["AggregatedHealthState"] == "Warning"
    ev = body["HealthEvents"][0]
    assert set(ev) == {"SourceId", "Property", "HealthState", "Description", "SequenceNumber",
                       "TimeToLiveInMilliSeconds", "RemoveWhenExpired", "SentAt", "ReceivedAt", "IsExpired",
                       "LastOkTransitionAt", "LastWarningTransitionAt", "LastErrorTransitionAt"}
    assert ev["TimeToLiveInMilliSeconds"] == 60000 and ev["SequenceNumber"] == "1"
    evaluation = body["UnhealthyEvaluations"][0]
    assert evaluation["Kind"] == "Event" and "queue depth 12000" in evaluation["Description"]


@pytest.mark.parametrize("body, field", [
    ({"Property": "p", "HealthState": "Ok", "SequenceNumber": 1}, "SourceId"),
    ({"SourceId": "s", "Property": "p", "HealthState": "Fine", "SequenceNumber": 1}, "HealthState"),
    ({"SourceId": "s", "Property": "p", "HealthState": "Ok", "SequenceNumber": -1}, "SequenceNumber"),
    ({"SourceId": "s", "Property": "p", "HealthState": "Ok", "TimeToLiveInMilliSeconds": "soon"},
     "TimeToLiveInMilliSeconds"),
    ({"SourceId": "s", "Property": "p", "HealthState": "Ok", "RemoveWhenExpired": "yes"}, "RemoveWhenExpired"),
    ([1, 2], "JSON object"),
])
def test_parse_report_names_the_bad_field(body, field):
    with pytest.raises(ValueError, match=field):
        parse_report(body)


def test_parse_report_accepts_sf_spellings():
    r = parse_report({"SourceId": "w", "Property": "p", "HealthState": "error", "SequenceNumber": "17",
                      "TimeToLiveInMilliSeconds": "PT30S", "Description": "x" * 10_000})
    assert r.state == E and r.sequence_number == 17 and r.ttl == 30.0
    assert len(r.description) == 4096 and r.description.endswith("[Truncated]")


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=4),
                           max_leaves=10)
fields = st.fixed_dictionaries({}, optional={k: json_values for k in (
    "SourceId", "Property", "HealthState", "SequenceNumber", "TimeToLiveInMilliSeconds", "RemoveWhenExpired",
    "Description", "SentAt")})


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, fields))
def test_parse_report_only_ever_raises_value_error(body):
    try:
        parse_report(body)
    except ValueError:
        pass
