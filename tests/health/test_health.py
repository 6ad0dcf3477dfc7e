"""The health store on the Service Fabric model, case by case."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.health.health_store import (
    MAX_DESCRIPTION,
    HealthReport,
    HealthState,
    HealthStore,
    ReservedSource,
    StaleReport,
    TooManyReports,
    parse_report,
)

W, E, OK = HealthState.WARNING, HealthState.ERROR, HealthState.OK


def rep(source="watchdog", prop="queue", state=E, seq=1, ttl=None, remove=False, description=""):
    return HealthReport(source, prop, state, description, ttl, remove, seq)


def iso(dt: datetime) -> str:
    return dt.isoformat().replace("+00:00", "Z")


def body(**fields):
    return {"SourceId": "watchdog", "Property": "queue", "HealthState": "Ok", "SequenceNumber": 1, **fields}


# --- sequence numbers and reserved sources ---------------------------------------------------

@pytest.mark.parametrize("seq", [5, 4])
def test_a_report_whose_sequence_is_not_greater_is_stale_and_changes_nothing(clock, seq):
    """Equal and lower SequenceNumbers are refused as stale and leave the stored report as it was."""
    store = HealthStore(clock)
    store.report(rep(seq=5, state=E))
    with pytest.raises(StaleReport, match=r"SequenceNumber: .* stale.*has 5"):
        store.report(rep(seq=seq, state=OK))
    assert store.aggregate() == E and store.snapshot()[0].sequence_number == 5
    store.report(rep(seq=6, state=OK))
    assert store.aggregate() == OK


def test_sequence_numbers_are_per_source_and_property(clock):
    """Staleness is judged per (SourceId, Property)."""
    store = HealthStore(clock)
    store.report(rep(prop="a", seq=9))
    store.report(rep(prop="b", seq=1))
    store.report(rep(source="other", prop="a", seq=1))
    assert len(store.snapshot()) == 3


def test_an_external_report_needs_a_sequence_number(clock):
    """A watchdog must number its reports."""
    with pytest.raises(ValueError, match="SequenceNumber: required"):
        HealthStore(clock).report(rep(seq=None))


@pytest.mark.parametrize("source", ["System.FM", "system.Hosting", "SYSTEM.x"])
def test_system_sources_are_reserved_case_insensitively(clock, source):
    """SourceIds starting with System. (any case) belong to the system."""
    store = HealthStore(clock)
    with pytest.raises(ReservedSource, match="SourceId: .*reserved"):
        store.report(rep(source=source))
    assert store.snapshot() == []


def test_a_source_merely_starting_with_system_is_allowed(clock):
    """Only the `System.` prefix is reserved, not every name starting with System."""
    store = HealthStore(clock)
    store.report(rep(source="Systemd"))
    assert store.snapshot()[0].report.source_id == "Systemd"


# --- expiry ----------------------------------------------------------------------------------

def test_expiry_removes_or_counts_as_error(clock):
    """Past its TTL a report is gone (RemoveWhenExpired) or counts as Error with IsExpired."""
    store = HealthStore(clock)
    store.report(rep(prop="gone", state=OK, ttl=30, remove=True))
    store.report(rep(prop="kept", state=OK, ttl=30, remove=False))
    clock.advance(29.9)
    assert store.aggregate() == OK and not any(e.is_expired for e in store.snapshot())
    clock.advance(0.1)
    events = {e.report.property: e for e in store.snapshot()}
    assert "gone" not in events, "RemoveWhenExpired: gone"
    kept = events["kept"]
    assert kept.is_expired and kept.state == E and kept.report.state == OK
    assert store.aggregate() == E
    assert kept.to_json()["IsExpired"] is True and kept.to_json()["HealthState"] == "Ok", "the report as sent"
    assert "expired at 2026-01-01T00:00:30Z" in store.unhealthy()[0]["Description"]


def test_a_fresh_report_renews_the_time_to_live(clock):
    """A watchdog reporting within its TTL never expires."""
    store = HealthStore(clock)
    store.report(rep(state=OK, ttl=30, seq=1))
    clock.advance(20)
    store.report(rep(state=OK, ttl=30, seq=2))
    clock.advance(20)
    assert store.aggregate() == OK


def test_prune_drops_only_expired_reports_that_asked_for_it(clock):
    """prune() removes expired RemoveWhenExpired reports and nothing else."""
    store = HealthStore(clock)
    store.report(rep(prop="a", ttl=1, remove=True))
    store.report(rep(prop="b", ttl=1))
    store.report(rep(prop="c"))
    clock.advance(2)
    store.prune()
    assert [e.report.property for e in store.snapshot()] == ["b", "c"]


# --- aggregation -----------------------------------------------------------------------------

def test_aggregate_is_the_worst_and_ok_when_empty(clock):
    """The aggregated state is the worst report's; no reports is Ok."""
    store = HealthStore(clock)
    assert store.aggregate() == OK and store.unhealthy() == []
    store.report(rep(prop="a", state=OK))
    store.report(rep(prop="b", state=W))
    assert store.aggregate() == W
    store.report(rep(prop="c", state=E))
    assert store.aggregate() == E
    assert [u["UnhealthyEvent"]["Property"] for u in store.unhealthy()] == ["c"], "only the worst explain it"


def test_consider_warning_as_error(clock):
    """ConsiderWarningAsError turns Warning into Error and says so in the evaluation."""
    store = HealthStore(clock)
    store.report(rep(prop="b", state=W, description="queue deep"))
    assert store.aggregate() == W
    assert store.aggregate(consider_warning_as_error=True) == E
    evaluation = store.unhealthy(consider_warning_as_error=True)[0]
    assert evaluation["AggregatedHealthState"] == "Error" and evaluation["ConsiderWarningAsError"] is True
    assert "counted as Error: ConsiderWarningAsError" in evaluation["Description"]
    assert store.to_json(consider_warning_as_error=True)["AggregatedHealthState"] == "Error"


def test_sources_filter_decides_which_reports_count(clock):
    """The probe's fail_on: an IMDS outage (SourceId imds) must not take the VM out of rotation."""
    store = HealthStore(clock)
    store.report(rep(prop="b", state=W))
    store.report(rep(source="imds", prop="poll", state=E))
    assert store.aggregate(sources=lambda s: s != "imds") == W
    assert store.aggregate(sources=lambda s: s == "nobody") == OK
    assert [u["UnhealthyEvent"]["SourceId"] for u in store.unhealthy(sources=lambda s: s != "imds")] == ["watchdog"]


# --- transition timestamps -------------------------------------------------------------------

def test_transition_timestamps_follow_service_fabric(clock):
    """Entering a state stamps it; a repeat changes nothing; leaving a state stamps when it was last in it."""
    store = HealthStore(clock)
    t0 = clock.now()
    store.report(rep(state=OK, seq=1))
    first = store.to_json()["HealthEvents"][0]
    assert (first["LastOkTransitionAt"], first["LastWarningTransitionAt"], first["LastErrorTransitionAt"]) == (
        iso(t0), None, None)
    clock.advance(10)
    t10 = clock.now()
    store.report(rep(state=E, seq=2))
    clock.advance(10)
    store.report(rep(state=E, seq=3))
    ev = store.to_json()["HealthEvents"][0]
    assert ev["LastOkTransitionAt"] == iso(t10), "left Ok when Error came"
    assert ev["LastErrorTransitionAt"] == iso(t10), "unchanged by a repeat"
    assert ev["LastWarningTransitionAt"] is None, "never Warning"
    clock.advance(10)
    t30 = clock.now()
    store.report(rep(state=OK, seq=4))
    ev = store.to_json()["HealthEvents"][0]
    assert (ev["LastOkTransitionAt"], ev["LastErrorTransitionAt"]) == (iso(t30), iso(t30))


def test_own_reports_keep_transitions_when_only_the_description_changes(clock):
    """A new description in the same state keeps the transition time."""
    store = HealthStore(clock)
    t0 = clock.now()
    store.set("rules", "cpu", E, "95 > 90")
    clock.advance(60)
    store.set("rules", "cpu", E, "96 > 90")
    ev = store.snapshot()[0]
    assert ev.last_error_transition_at == t0 and ev.report.description == "96 > 90"


# --- maintd's own reports --------------------------------------------------------------------

def test_own_reports_are_numbered_and_an_unchanged_one_is_left_alone(clock):
    """set() numbers reports itself and does not renumber an identical report."""
    store = HealthStore(clock)
    store.set("imds", "poll", OK, "polling")
    first = store.snapshot()[0]
    clock.advance(5)
    store.set("imds", "poll", OK, "polling")
    again = store.snapshot()[0]
    assert (again.sequence_number, again.received_at) == (first.sequence_number, first.received_at)
    store.set("imds", "poll", W, "3 polls failed")
    assert store.snapshot()[0].sequence_number == first.sequence_number + 1
    store.remove("imds", "poll")
    assert store.snapshot() == []


def test_own_numbering_stays_above_an_external_report_on_the_same_key(clock):
    """A watchdog's report does not make maintd's next own report stale."""
    store = HealthStore(clock)
    store.report(rep(source="rules", prop="cpu", state=OK, seq=10**12))
    store.set("rules", "cpu", E, "hot")
    ev = store.snapshot()[0]
    assert ev.sequence_number > 10**12 and ev.report.state == E


def test_own_reports_with_a_ttl_are_refreshed_every_time(clock):
    """A TTL heartbeat must renew even when nothing else changed."""
    store = HealthStore(clock)
    store.set("maintd", "alive", OK, "", ttl=10)
    clock.advance(8)
    store.set("maintd", "alive", OK, "", ttl=10)
    clock.advance(8)
    assert store.aggregate() == OK


def test_the_store_refuses_a_new_key_when_full_but_accepts_updates(clock):
    """max_reports bounds the number of keys, not the updates to existing ones."""
    store = HealthStore(clock, max_reports=2)
    store.report(rep(prop="a"))
    store.report(rep(prop="b"))
    with pytest.raises(TooManyReports, match="2 reports"):
        store.report(rep(prop="c"))
    store.report(rep(prop="a", seq=2, state=OK))
    assert [e.report.state for e in store.snapshot()] == [OK, E]


# --- parsing a watchdog's report -------------------------------------------------------------

@pytest.mark.parametrize("fields, field", [
    ({"SourceId": None}, "SourceId"),
    ({"SourceId": "  "}, "SourceId"),
    ({"Property": 7}, "Property"),
    ({"HealthState": "Fine"}, "HealthState"),
    ({"HealthState": None}, "HealthState"),
    ({"SequenceNumber": -1}, "SequenceNumber"),
    ({"SequenceNumber": 1.5}, "SequenceNumber"),
    ({"SequenceNumber": True}, "SequenceNumber"),
    ({"SequenceNumber": "-3"}, "SequenceNumber"),
    ({"TimeToLiveInMilliSeconds": "soon"}, "TimeToLiveInMilliSeconds"),
    ({"TimeToLiveInMilliSeconds": "PT30X"}, "TimeToLiveInMilliSeconds"),
    ({"TimeToLiveInMilliSeconds": 0}, "TimeToLiveInMilliSeconds"),
    ({"TimeToLiveInMilliSeconds": -1000}, "TimeToLiveInMilliSeconds"),
    ({"TimeToLiveInMilliSeconds": True}, "TimeToLiveInMilliSeconds"),
    ({"RemoveWhenExpired": "yes"}, "RemoveWhenExpired"),
    ({"Description": ["x"]}, "Description"),
    ({"SentAt": "yesterday"}, "SentAt"),
])
def test_parse_report_names_the_bad_field(fields, field):
    """Each malformed field is refused with a message that starts with the field's name."""
    with pytest.raises(ValueError, match=f"^{field}: "):
        parse_report(body(**fields))


@pytest.mark.parametrize("value", [[1, 2], "text", None, 3])
def test_parse_report_wants_a_json_object(value):
    """A body that is not an object is refused."""
    with pytest.raises(ValueError, match="JSON object"):
        parse_report(value)


@pytest.mark.parametrize("fields", [{"SequenceNumber": "²"}, {"TimeToLiveInMilliSeconds": "²"},
                                    {"SequenceNumber": "9" * 5000}])
def test_digit_like_text_that_is_not_a_number_is_refused_naming_the_field(fields):
    """Text that looks like digits but is no int64 is refused naming the field."""
    with pytest.raises(ValueError, match=f"^{next(iter(fields))}: "):
        parse_report(body(**fields))


def test_parse_report_accepts_service_fabric_spellings():
    """Case-insensitive states, text SequenceNumbers, TTLs in ms (number or text) or ISO 8601."""
    r = parse_report(body(HealthState="error", SequenceNumber="17", TimeToLiveInMilliSeconds="PT30S",
                          RemoveWhenExpired=True, SentAt="2026-01-01T00:00:00Z"))
    assert (r.state, r.sequence_number, r.ttl, r.remove_when_expired) == (E, 17, 30.0, True)
    assert r.sent_at == datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_report(body(TimeToLiveInMilliSeconds=1500)).ttl == 1.5
    assert parse_report(body(TimeToLiveInMilliSeconds="60000")).ttl == 60.0
    assert parse_report(body(TimeToLiveInMilliSeconds="pt1m")).ttl == 60.0
    plain = parse_report(body(SequenceNumber=None))
    assert (plain.ttl, plain.sequence_number, plain.description, plain.sent_at) == (None, None, "", None)


def test_a_long_description_is_truncated_like_service_fabric():
    """Over 4096 characters the description is cut to 4096 ending in [Truncated]."""
    exact = parse_report(body(Description="x" * MAX_DESCRIPTION)).description
    assert exact == "x" * MAX_DESCRIPTION
    cut = parse_report(body(Description="x" * 10_000)).description
    assert len(cut) == MAX_DESCRIPTION == 4096 and cut.endswith(" [Truncated]")


# --- the JSON a client reads -----------------------------------------------------------------

def test_to_json_uses_service_fabric_field_names(clock):
    """/v1/health has Service Fabric's field names and value spellings."""
    store = HealthStore(clock)
    store.report(parse_report(body(HealthState="Warning", Description="queue depth 12000",
                                   TimeToLiveInMilliSeconds=60000, SentAt="2025-12-31T23:59:59Z")))
    clock.advance(1)
    store.set("imds", "poll", OK, "polling")
    doc = store.to_json()
    assert set(doc) == {"AggregatedHealthState", "UnhealthyEvaluations", "HealthEvents"}
    assert doc["AggregatedHealthState"] == "Warning"
    ev = doc["HealthEvents"][1]
    assert set(ev) == {"SourceId", "Property", "HealthState", "Description", "SequenceNumber",
                       "TimeToLiveInMilliSeconds", "RemoveWhenExpired", "SentAt", "ReceivedAt", "IsExpired",
                       "LastOkTransitionAt", "LastWarningTransitionAt", "LastErrorTransitionAt"}
    assert ev == {"SourceId": "watchdog", "Property": "queue", "HealthState": "Warning",
                  "Description": "queue depth 12000", "SequenceNumber": "1", "TimeToLiveInMilliSeconds": 60000,
                  "RemoveWhenExpired": False, "SentAt": "2025-12-31T23:59:59Z", "ReceivedAt": "2026-01-01T00:00:00Z",
                  "IsExpired": False, "LastOkTransitionAt": None, "LastWarningTransitionAt": "2026-01-01T00:00:00Z",
                  "LastErrorTransitionAt": None}
    own = doc["HealthEvents"][0]
    assert own["TimeToLiveInMilliSeconds"] is None and own["SentAt"] == own["ReceivedAt"] == "2026-01-01T00:00:01Z"
    evaluation = doc["UnhealthyEvaluations"][0]
    assert set(evaluation) == {"Kind", "Description", "AggregatedHealthState", "ConsiderWarningAsError",
                               "UnhealthyEvent"}
    assert evaluation["Kind"] == "Event" and evaluation["UnhealthyEvent"] == ev
    assert evaluation["Description"] == ("Warning event: SourceId='watchdog', Property='queue': queue depth 12000")


# --- robustness ------------------------------------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=4),
                           max_leaves=10)
likely = {
    "HealthState": st.sampled_from(["Ok", "warning", "ERROR", " Error ", "Unknown", ""]),
    "SequenceNumber": st.integers() | st.text(alphabet="0123456789- ", max_size=8),
    "TimeToLiveInMilliSeconds": st.integers() | st.floats() | st.text(alphabet="PTDHMS0123456789.", max_size=8),
    "SentAt": st.datetimes().map(datetime.isoformat) | st.text(max_size=10),
}
fields = st.fixed_dictionaries({}, optional={k: likely.get(k, st.none()) | json_values for k in (
    "SourceId", "Property", "HealthState", "SequenceNumber", "TimeToLiveInMilliSeconds", "RemoveWhenExpired",
    "Description", "SentAt")})


@settings(max_examples=400, deadline=None)
@given(st.one_of(json_values, fields))
def test_parse_report_only_ever_raises_value_error(value):
    """Whatever a client POSTs, the API answers 400, never 500."""
    try:
        parse_report(value)
    except ValueError:
        pass
