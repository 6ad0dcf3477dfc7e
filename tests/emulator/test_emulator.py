"""The IMDS emulator over real loopback sockets: wire format, validation, life cycle, faults, admin API, CLI.

Time is a FakeClock; the only real waits are the short fault delays a test measures.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from agent.clock import FakeClock
from agent.emulator import Emulator

SE = "/metadata/scheduledevents"
V = "2020-07-01"
GUID = re.compile(r"^[0-9A-F]{8}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{12}$")
ROOT = Path(__file__).resolve().parents[2]
ERR_METADATA = {"error": "Bad request. Required metadata header not specified"}
ERR_VERSION = {"error": "Bad request. api-version is invalid or was not specified in the request. "
                        "For more information refer to aka.ms/azureimds",
               "newest-versions": ["2020-10-01", "2020-09-01", "2020-07-15"]}

Make = Callable[..., tuple[Emulator, dict[str, str]]]


@pytest.fixture
def session() -> Iterator[requests.Session]:
    s = requests.Session()
    s.trust_env = False
    yield s
    s.close()


@pytest.fixture
def make(clock: FakeClock) -> Iterator[Make]:
    """Start an emulator on the fake clock (no rate limit unless asked); always stopped."""
    started: list[Emulator] = []

    def make(vms: tuple[str, ...] = ("vm-1",), **kwargs: Any) -> tuple[Emulator, dict[str, str]]:
        kwargs.setdefault("rate_limit", None)
        emu = Emulator(list(vms), clock=clock, **kwargs)
        started.append(emu)
        return emu, emu.start()

    yield make
    for emu in started:
        emu.stop()


def get(s: requests.Session, base: str, version: str | None = V, headers: dict[str, str] | None = None,
        path: str = SE, params: dict[str, str] | None = None, **kwargs: Any) -> requests.Response:
    query = {**({"api-version": version} if version else {}), **(params or {})}
    return s.get(base + path, params=query, headers={"Metadata": "true", **(headers or {})}, timeout=5, **kwargs)


def approve(s: requests.Session, base: str, *event_ids: str) -> requests.Response:
    return s.post(base + SE, params={"api-version": V}, headers={"Metadata": "true"}, timeout=5,
                  json={"StartRequests": [{"EventId": e} for e in event_ids]})


def events(s: requests.Session, base: str, version: str = V) -> list[dict[str, Any]]:
    return get(s, base, version).json()["Events"]


def raw(base: str, method: str, target: str, headers: dict[str, str] | None = None,
        body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with http.client, for what requests would normalise (duplicate parameters, methods)."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    """Poll for a condition another thread brings about (not for time to pass)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


# --- wire format -----------------------------------------------------------------------------

def test_an_idle_vm_gets_incarnation_1_and_no_events_as_utf8_json(make, session):
    """The documented idle answer, with IMDS's Content-Type and an exact Content-Length."""
    _, urls = make()
    r = get(session, urls["vm-1"])
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "application/json; charset=utf-8"
    assert int(r.headers["Content-Length"]) == len(r.content)
    assert r.json() == {"DocumentIncarnation": 1, "Events": []}


def test_an_event_carries_every_field_in_imds_order_with_rfc1123_not_before(make, session, clock):
    """Uppercase GUID, RFC 1123 GMT NotBefore = now + notice, numbers as JSON numbers, field order as captured."""
    emu, urls = make()
    eid = emu.add_event(event_type="Freeze", resources=["vm-1"], notice=300, duration_seconds=5,
                        description="Host server is undergoing maintenance.")
    assert GUID.match(eid)
    doc = get(session, urls["vm-1"]).json()
    assert doc["DocumentIncarnation"] == 2
    (event,) = doc["Events"]
    assert list(event) == ["EventId", "EventStatus", "EventType", "ResourceType", "Resources", "NotBefore",
                           "Description", "EventSource", "DurationInSeconds"]
    assert event == {"EventId": eid, "EventStatus": "Scheduled", "EventType": "Freeze",
                     "ResourceType": "VirtualMachine", "Resources": ["vm-1"],
                     "NotBefore": "Thu, 01 Jan 2026 00:05:00 GMT",
                     "Description": "Host server is undergoing maintenance.", "EventSource": "Platform",
                     "DurationInSeconds": 5}
    assert parsedate_to_datetime(event["NotBefore"]) == clock.now().replace(minute=5)


def test_the_default_notice_is_the_documented_minimum_for_the_type(make, clock):
    """Reboot 15 min, Redeploy 10 min, Preempt 30 s when no notice is given."""
    emu, _ = make()
    for event_type in ("Reboot", "Redeploy", "Preempt"):
        emu.add_event(event_type=event_type)
    not_before = {e["EventType"]: parsedate_to_datetime(e["NotBefore"]) for e in emu.document("vm-1")["Events"]}
    assert {t: (nb - clock.now()).total_seconds() for t, nb in not_before.items()} == \
        {"Reboot": 900, "Redeploy": 600, "Preempt": 30}


def test_keep_alive_connection_serves_several_answers_including_errors(make):
    """One connection, many requests (the agent's keep-alive session): every answer is framed right."""
    emu, urls = make()
    u = urlsplit(urls["vm-1"])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
    try:
        for headers, status in (({"Metadata": "true"}, 200), ({}, 400), ({"Metadata": "true"}, 200)):
            conn.request("GET", f"{SE}?api-version={V}", headers=headers)
            r = conn.getresponse()
            assert r.status == status and json.loads(r.read())
        conn.request("POST", f"{SE}?api-version={V}", body=b'{"StartRequests": [{"EventId": "X"}]}',
                     headers={"Metadata": "true"})
        r = conn.getresponse()
        assert (r.status, r.read()) == (200, b"")
        assert r.getheader("Connection") != "close"
    finally:
        conn.close()
    assert [r.status for r in emu.requests()] == [200, 400, 200, 200]


def test_requests_are_recorded_with_headers_query_body_status_and_time(make, session, clock):
    """What tests assert on: every IMDS request, answered status included; admin calls are not recorded."""
    emu, urls = make()
    session.get(urls["vm-1"] + "/admin/requests", timeout=5)
    approve(session, urls["vm-1"], "ABC")
    (rec,) = emu.requests("vm-1")
    assert (rec.vm, rec.method, rec.path, rec.query, rec.status) == ("vm-1", "POST", SE, "api-version=2020-07-01", 200)
    assert rec.headers["Metadata"] == "true" and json.loads(rec.body) == {"StartRequests": [{"EventId": "ABC"}]}
    assert (rec.time, rec.monotonic) == (clock.now().timestamp(), clock.monotonic())
    assert emu.requests("vm-2") == []


# --- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("method, target, headers, status, body", [
    ("GET", f"{SE}?api-version={V}", {"Metadata": "true", "X-Forwarded-For": "10.0.0.4"}, 400,
     {"error": "Bad request. Requests with X-Forwarded-For header are not allowed"}),
    ("GET", f"{SE}?api-version={V}", {"X-Forwarded-For": "10.0.0.4"}, 400,
     {"error": "Bad request. Requests with X-Forwarded-For header are not allowed"}),
    ("GET", f"{SE}?api-version={V}", {}, 400, ERR_METADATA),
    ("GET", f"{SE}?api-version={V}", {"Metadata": "yes"}, 400, ERR_METADATA),
    ("GET", f"{SE}?api-version=bogus", {}, 400, ERR_METADATA),
    ("GET", f"{SE}?api-version={V}&api-version={V}", {"Metadata": "true"}, 400,
     {"error": "Bad request. Query parameters should not be repeated"}),
    ("GET", SE, {"Metadata": "true"}, 400, ERR_VERSION),
    ("GET", f"{SE}?api-version=2021-12-13", {"Metadata": "true"}, 400, ERR_VERSION),
    ("PUT", f"{SE}?api-version=bogus", {"Metadata": "true"}, 400, ERR_VERSION),
    ("PUT", f"{SE}?api-version={V}", {"Metadata": "true"}, 405, {"error": "Method Not Allowed"}),
    ("DELETE", f"{SE}?api-version={V}", {"Metadata": "true"}, 405, {"error": "Method Not Allowed"}),
    ("GET", "/metadata/nothing?api-version=2021-02-01", {"Metadata": "true"}, 404, {"error": "Not found"}),
], ids=["xff", "xff-before-metadata", "no-metadata", "metadata-not-true", "metadata-before-version", "duplicate",
        "no-version", "unknown-version", "version-before-method", "put", "delete", "unknown-path"])
def test_validation_answers_in_imds_order_with_its_bodies(make, method, target, headers, status, body):
    """X-Forwarded-For, Metadata, duplicates, api-version, method: the first failing check answers."""
    _, urls = make()
    got, answer_headers, content = raw(urls["vm-1"], method, target, headers)
    assert (got, json.loads(content)) == (status, body)
    assert answer_headers["Content-Type"] == "application/json; charset=utf-8"
    if status == 405:
        assert answer_headers["Allow"] == "GET, POST"


def test_metadata_header_value_is_case_insensitive(make, session):
    """The docs use both `true` and `True`."""
    _, urls = make()
    assert get(session, urls["vm-1"], headers={"Metadata": "True"}).status_code == 200


@pytest.mark.parametrize("version, fields, resources", [
    ("2017-03-01", [], ["_vm-1"]),
    ("2017-08-01", [], ["vm-1"]),
    ("2019-04-01", ["Description"], ["vm-1"]),
    ("2019-08-01", ["Description", "EventSource"], ["vm-1"]),
    ("2020-07-01", ["Description", "EventSource", "DurationInSeconds"], ["vm-1"]),
])
def test_fields_are_gated_by_api_version(make, session, version, fields, resources):
    """Older versions leave out later fields; 2017-03-01 prefixes IaaS VM names with an underscore."""
    emu, urls = make()
    emu.add_event(event_type="Reboot", resources=["vm-1"], notice=60)
    (event,) = events(session, urls["vm-1"], version)
    base = ["EventId", "EventStatus", "EventType", "ResourceType", "Resources", "NotBefore"]
    assert list(event) == base + fields
    assert event["Resources"] == resources


def test_event_types_newer_than_the_api_version_are_not_sent(make, session):
    """Preempt needs 2017-11-01 and Terminate 2019-01-01."""
    emu, urls = make()
    emu.add_event(event_type="Preempt")
    emu.add_event(event_type="Terminate")
    seen = {v: sorted(e["EventType"] for e in events(session, urls["vm-1"], v))
            for v in ("2017-08-01", "2017-11-01", "2019-01-01")}
    assert seen == {"2017-08-01": [], "2017-11-01": ["Preempt"], "2019-01-01": ["Preempt", "Terminate"]}


# --- life cycle ------------------------------------------------------------------------------

def test_approval_starts_the_event_then_it_is_removed_after_started_duration(make, session, clock):
    """Scheduled → POST → Started with NotBefore "" → gone after started_duration; incarnation +1 each time."""
    emu, urls = make(started_duration=30)
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
    assert approve(session, urls["vm-1"], eid).status_code == 200
    doc = get(session, urls["vm-1"]).json()
    assert doc["DocumentIncarnation"] == 3
    assert (doc["Events"][0]["EventStatus"], doc["Events"][0]["NotBefore"]) == ("Started", "")
    clock.advance(29)
    assert events(session, urls["vm-1"])
    clock.advance(1)
    assert get(session, urls["vm-1"]).json() == {"DocumentIncarnation": 4, "Events": []}
    (a,) = emu.approvals("vm-1")
    assert (a.vm, a.event_ids, a.unknown) == ("vm-1", [eid], [])


def test_approving_twice_is_200_and_changes_nothing(make, session):
    """"Always returns 200 if it's passed a valid event ID, even if another VM already approved"."""
    emu, urls = make()
    eid = emu.add_event(resources=["vm-1"], notice=600)
    approve(session, urls["vm-1"], eid)
    before = emu.document("vm-1")
    assert approve(session, urls["vm-1"], eid).status_code == 200
    assert emu.document("vm-1") == before


def test_not_before_starts_the_event_and_a_positive_duration_removes_it(make, session, clock):
    """No approval: Started when NotBefore comes; removed after DurationInSeconds when that is > 0."""
    emu, urls = make(started_duration=600)
    emu.add_event(event_type="Freeze", resources=["vm-1"], notice=60, duration_seconds=9)
    clock.advance(59.9)
    assert events(session, urls["vm-1"])[0]["EventStatus"] == "Scheduled"
    clock.advance(0.1)
    assert events(session, urls["vm-1"])[0]["EventStatus"] == "Started"
    clock.advance(9)
    assert events(session, urls["vm-1"]) == []


def test_time_scale_shortens_notice_and_durations(make, session, clock):
    """time_scale=60: 15 emulated minutes of notice are 15 real seconds."""
    emu, urls = make(time_scale=60, started_duration=600)
    emu.add_event(resources=["vm-1"], notice=900)
    (event,) = events(session, urls["vm-1"])
    assert (parsedate_to_datetime(event["NotBefore"]) - clock.now()).total_seconds() == 15
    clock.advance(15)
    emu.tick()
    clock.advance(10)
    assert events(session, urls["vm-1"]) == []


def test_cancel_path_removes_a_scheduled_event_without_starting_it(make, session):
    """Azure cancels: Scheduled → gone, incarnation +1; a Started event cannot be canceled."""
    emu, urls = make()
    eid = emu.add_event(resources=["vm-1"], notice=600)
    emu.cancel_event(eid)
    assert get(session, urls["vm-1"]).json() == {"DocumentIncarnation": 3, "Events": []}
    started = emu.add_event(resources=["vm-1"], notice=600)
    emu.start_event(started)
    with pytest.raises(ValueError, match="only a Scheduled event"):
        emu.cancel_event(started)
    emu.complete_event(started)
    assert emu.document("vm-1") == {"DocumentIncarnation": 6, "Events": []}
    with pytest.raises(KeyError):
        emu.complete_event(started)


def test_hardware_failure_reboot_appears_already_started(make, session):
    """No Scheduled phase: Started from the first document, NotBefore ""."""
    emu, urls = make()
    emu.add_event(event_type="Reboot", resources=["vm-1"], status="Started")
    (event,) = events(session, urls["vm-1"])
    assert (event["EventStatus"], event["NotBefore"]) == ("Started", "")


def test_reset_incarnation_drops_events_and_restarts_at_1(make, session):
    """The 24 h disable: the incarnation goes back to 1, which clients must treat as a reset."""
    emu, urls = make()
    emu.add_event(resources=["vm-1"])
    emu.add_event(resources=["vm-1"])
    emu.reset_incarnation()
    assert get(session, urls["vm-1"]).json() == {"DocumentIncarnation": 1, "Events": []}


def test_every_vm_sees_events_for_its_availability_set_on_its_own_port(make, session):
    """Broadcast: vm-1 sees vm-2's event, both incarnations move; vm-1 may approve it for vm-2."""
    emu, urls = make(("vm-1", "vm-2"))
    assert urls["vm-1"] != urls["vm-2"]
    eid = emu.add_event(resources=["vm-2"], notice=600)
    docs = {vm: get(session, url).json() for vm, url in urls.items()}
    assert docs["vm-1"] == docs["vm-2"] and docs["vm-1"]["DocumentIncarnation"] == 2
    approve(session, urls["vm-1"], eid)
    assert events(session, urls["vm-2"])[0]["EventStatus"] == "Started"
    assert [a.vm for a in emu.approvals()] == ["vm-1"] and emu.approvals("vm-2") == []


def test_without_broadcast_a_vm_sees_and_approves_only_its_own_events(make, session):
    """broadcast=False: another VM's event is invisible, its incarnation stays, its approval is a no-op."""
    emu, urls = make(("vm-1", "vm-2"), broadcast=False)
    eid = emu.add_event(resources=["vm-2"], notice=600)
    assert get(session, urls["vm-1"]).json() == {"DocumentIncarnation": 1, "Events": []}
    assert approve(session, urls["vm-1"], eid).status_code == 200
    assert events(session, urls["vm-2"])[0]["EventStatus"] == "Scheduled"
    assert emu.approvals("vm-1")[0].unknown == [eid]


def test_approvals_required_waits_for_that_many_vms(make, session):
    """Shared infrastructure: the event starts on the second distinct VM's approval, not a repeat."""
    emu, urls = make(("vm-1", "vm-2"), approvals_required=2)
    eid = emu.add_event(resources=["vm-1", "vm-2"], notice=600)
    approve(session, urls["vm-1"], eid)
    approve(session, urls["vm-1"], eid)
    assert events(session, urls["vm-1"])[0]["EventStatus"] == "Scheduled"
    approve(session, urls["vm-2"], eid)
    assert events(session, urls["vm-1"])[0]["EventStatus"] == "Started"


def test_a_terminate_batch_starts_only_when_every_delete_in_it_is_approved(make, session):
    """VMSS: an approved Terminate waits for the other pending Terminate with the same NotBefore."""
    emu, urls = make(("vm-1", "vm-2"))
    first = emu.add_event(event_type="Terminate", resources=["vm-1"])
    second = emu.add_event(event_type="Terminate", resources=["vm-2"])
    approve(session, urls["vm-1"], first)
    assert {e["EventStatus"] for e in events(session, urls["vm-1"])} == {"Scheduled"}
    approve(session, urls["vm-2"], second)
    assert {e["EventStatus"] for e in events(session, urls["vm-1"])} == {"Started"}


@pytest.mark.parametrize("body", [b"", b"not json", b"[]", b"{}", b'{"StartRequests": []}',
                                  b'{"StartRequests": {}}', b'{"StartRequests": [{}]}',
                                  b'{"StartRequests": [{"EventId": 5}]}', b'{"StartRequests": [{"EventId": ""}]}'])
def test_a_malformed_start_requests_body_is_400(make, body):
    """Missing, empty or mistyped StartRequests: 400, and nothing is approved."""
    emu, urls = make()
    status, _, content = raw(urls["vm-1"], "POST", f"{SE}?api-version={V}", {"Metadata": "true"}, body)
    assert status == 400 and "StartRequests" in json.loads(content)["error"]
    assert emu.approvals() == []


def test_a_post_needs_no_content_type_and_ignores_a_document_incarnation(make):
    """The docs' curl example sends neither JSON Content-Type nor a current incarnation."""
    emu, urls = make()
    eid = emu.add_event(resources=["vm-1"], notice=600)
    body = json.dumps({"DocumentIncarnation": "5", "StartRequests": [{"EventId": eid}]}).encode()
    status, _, _ = raw(urls["vm-1"], "POST", f"{SE}?api-version={V}",
                       {"Metadata": "true", "Content-Type": "application/x-www-form-urlencoded"}, body)
    assert status == 200 and emu.document("vm-1")["Events"][0]["EventStatus"] == "Started"


@pytest.mark.parametrize("mode, status, recorded", [("ok", 200, 1), ("400", 400, 0)])
def test_approving_an_unknown_event_is_configurable(make, session, mode, status, recorded):
    """Undocumented on IMDS: a 200 no-op by default (recorded as unknown), or 400."""
    emu, urls = make(unknown_event=mode)
    r = approve(session, urls["vm-1"], "00000000-0000-0000-0000-000000000000")
    assert r.status_code == status
    assert len(emu.approvals()) == recorded


# --- other routes ----------------------------------------------------------------------------

def test_compute_metadata_names_the_vm(make, session):
    """`compute.name` is what Resources lists; leaves need format=text; /metadata/versions is unversioned."""
    _, urls = make(("vm-1", "vm-2"))
    compute = get(session, urls["vm-2"], "2021-02-01", path="/metadata/instance/compute").json()
    assert compute["name"] == "vm-2" and compute["resourceId"].endswith("/virtualMachines/vm-2")
    assert all(isinstance(v, str) for v in compute.values() if not isinstance(v, dict))
    assert all(isinstance(v, str) for v in compute["osProfile"].values())
    leaf = get(session, urls["vm-2"], "2021-02-01", path="/metadata/instance/compute/name",
               params={"format": "text"})
    assert (leaf.status_code, leaf.text, leaf.headers["Content-Type"]) == (200, "vm-2", "text/plain; charset=utf-8")
    assert get(session, urls["vm-2"], "2021-02-01", path="/metadata/instance/compute/name").status_code == 400
    assert get(session, urls["vm-2"], None, path="/metadata/instance/compute").json() == ERR_VERSION
    assert "2021-02-01" in get(session, urls["vm-2"], None, path="/metadata/versions").json()["apiVersions"]


def test_a_uniform_scale_set_vm_has_its_scale_set_and_base36_computer_name(make, session):
    """`web_15` is instance 15 of scale set `web`: computer name web00000f; `vm-1` is a plain VM."""
    _, urls = make(("web_15", "vm-1"))
    compute = get(session, urls["web_15"], "2021-02-01", path="/metadata/instance/compute").json()
    assert (compute["vmScaleSetName"], compute["osProfile"]["computerName"]) == ("web", "web00000f")
    leaf = get(session, urls["web_15"], "2021-02-01", path="/metadata/instance/compute/osProfile/computerName",
               params={"format": "text"})
    assert leaf.text == "web00000f"
    plain = get(session, urls["vm-1"], "2021-02-01", path="/metadata/instance/compute").json()
    assert (plain["vmScaleSetName"], plain["osProfile"]["computerName"]) == ("", "vm-1")


# --- rate limit and ETag ---------------------------------------------------------------------

def test_the_rate_limit_answers_429_until_the_bucket_refills(make, session, clock):
    """5 requests/s per VM by default: with the clock held the bucket stays empty; admin calls are free."""
    emu, urls = make(("vm-1", "vm-2"), rate_limit=5)
    assert [get(session, urls["vm-1"]).status_code for _ in range(6)] == [200] * 5 + [429]
    assert get(session, urls["vm-1"]).json() == {"error": "Too many requests"}
    assert get(session, urls["vm-2"]).status_code == 200, "each VM has its own limit"
    assert session.get(urls["vm-1"] + "/admin/requests", timeout=5).status_code == 200
    clock.advance(0.2)
    assert [get(session, urls["vm-1"]).status_code for _ in range(2)] == [200, 429]


def test_etag_and_if_none_match_give_304_until_the_document_changes(make, session):
    """An unchanged document is a 304 without a body; any change is a 200 with a new ETag."""
    emu, urls = make()
    first = get(session, urls["vm-1"])
    tag = first.headers["ETag"]
    same = get(session, urls["vm-1"], headers={"If-None-Match": tag})
    assert (same.status_code, same.content, same.headers["ETag"]) == (304, b"", tag)
    emu.add_event(resources=["vm-1"])
    changed = get(session, urls["vm-1"], headers={"If-None-Match": tag})
    assert changed.status_code == 200 and changed.headers["ETag"] != tag
    assert get(session, urls["vm-1"], "2019-08-01", headers={"If-None-Match": changed.headers["ETag"]}).status_code \
        == 200, "another api-version renders another document"


def test_etag_can_be_switched_off(make, session):
    """etag=False (unverified on real IMDS): no ETag header, If-None-Match ignored."""
    _, urls = make(etag=False)
    r = get(session, urls["vm-1"], headers={"If-None-Match": "*"})
    assert r.status_code == 200 and "ETag" not in r.headers


# --- faults ----------------------------------------------------------------------------------

@pytest.mark.parametrize("status, error", [(404, "Not found"), (410, "Gone"), (429, "Too many requests"),
                                           (500, "Internal server error"), (503, "Service unavailable")])
def test_a_status_fault_answers_with_an_imds_like_body_for_count_requests(make, session, status, error):
    """`count` limits the fault to the next N requests; Retry-After when asked."""
    emu, urls = make()
    emu.add_fault(kind="status", status=status, count=2, retry_after=7)
    answers = [get(session, urls["vm-1"]) for _ in range(3)]
    assert [r.status_code for r in answers] == [status, status, 200]
    assert answers[0].json() == {"error": error} and answers[0].headers["Retry-After"] == "7"
    assert [r.status for r in emu.requests()] == [status, status, 200]


def test_a_fault_with_a_duration_ends_when_the_clock_passes_it(make, session, clock):
    """`duration` is emulated seconds from now."""
    emu, urls = make()
    emu.add_fault(kind="status", status=500, duration=10)
    clock.advance(9.9)
    assert get(session, urls["vm-1"]).status_code == 500
    clock.advance(0.1)
    assert get(session, urls["vm-1"]).status_code == 200


def test_faults_can_target_one_vm_a_path_or_a_method(make, session):
    """vm, path prefix and method narrow a fault; clear_faults removes them all."""
    emu, urls = make(("vm-1", "vm-2"))
    emu.add_fault(vm="vm-2", kind="status", status=503)
    emu.add_fault(kind="status", status=410, path="/metadata/instance")
    emu.add_fault(kind="status", status=500, method="post")
    assert get(session, urls["vm-1"]).status_code == 200
    assert get(session, urls["vm-2"]).status_code == 503
    assert get(session, urls["vm-1"], "2021-02-01", path="/metadata/instance/compute").status_code == 410
    assert approve(session, urls["vm-1"], "X").status_code == 500
    emu.clear_faults()
    assert get(session, urls["vm-2"]).status_code == 200


def test_faults_come_before_validation(make):
    """A broken path answers whatever the request: even one without the Metadata header."""
    emu, urls = make()
    emu.add_fault(kind="proxy_504")
    status, headers, body = raw(urls["vm-1"], "GET", SE)
    assert status == 504 and headers["Content-Type"] == "text/html" and b"Gateway Timeout" in body


def test_malformed_and_wrong_content_type_faults_answer_200_with_unusable_bodies(make, session):
    """Truncated JSON with a JSON type, then an HTML page, both 200."""
    emu, urls = make()
    emu.add_fault(kind="malformed", count=1)
    emu.add_fault(kind="wrong_content_type", count=1)
    bad = get(session, urls["vm-1"])
    assert bad.status_code == 200 and bad.headers["Content-Type"].startswith("application/json")
    with pytest.raises(ValueError):
        bad.json()
    html = get(session, urls["vm-1"])
    assert html.status_code == 200 and html.headers["Content-Type"].startswith("text/html")
    assert get(session, urls["vm-1"]).json()["DocumentIncarnation"] == 1


@pytest.mark.parametrize("kind, error", [("reset", requests.ConnectionError),
                                         ("reset_mid_body", requests.exceptions.ChunkedEncodingError)])
def test_reset_faults_drop_the_connection(make, session, kind, error):
    """A reset before any answer, or in the middle of the body; the next request works on a new connection."""
    emu, urls = make()
    emu.add_fault(kind=kind, count=1)
    with pytest.raises(error):
        get(session, urls["vm-1"])
    assert get(session, urls["vm-1"]).status_code == 200
    assert emu.requests()[0].status is None


def test_latency_delays_the_answer_by_emulated_seconds(make, session):
    """delay is scaled by time_scale: 2 emulated seconds at 10x are 0.2 s."""
    emu, urls = make(time_scale=10)
    emu.add_fault(kind="latency", delay=2, count=1)
    t0 = time.monotonic()
    assert get(session, urls["vm-1"]).status_code == 200
    slow = time.monotonic() - t0
    t0 = time.monotonic()
    get(session, urls["vm-1"])
    assert slow >= 0.2 > time.monotonic() - t0


def test_latency_combines_with_an_answering_fault(make, session):
    """Held back, then answered by the status fault."""
    emu, urls = make(time_scale=20)
    emu.add_fault(kind="status", status=503, count=1)
    emu.add_fault(kind="latency", delay=2, count=1)
    t0 = time.monotonic()
    assert get(session, urls["vm-1"]).status_code == 503
    assert time.monotonic() - t0 >= 0.1


def test_first_call_delay_hits_each_vms_first_request_and_again_after_a_reset(make, session):
    """IMDS's slow first call after enabling Scheduled Events, scaled by time_scale."""
    emu, urls = make(("vm-1", "vm-2"), time_scale=10)
    emu.add_fault(kind="first_call_delay", delay=2)

    def took(vm: str) -> float:
        t0 = time.monotonic()
        assert get(session, urls[vm]).status_code == 200
        return time.monotonic() - t0

    assert took("vm-1") >= 0.2 > took("vm-1")
    emu.reset_incarnation()
    assert took("vm-1") >= 0.2


def test_hang_answers_nothing_until_the_client_gives_up(make, session):
    """The client's read timeout fires; the next request (fault count used up) is answered."""
    emu, urls = make()
    emu.add_fault(kind="hang", count=1)
    with pytest.raises(requests.ReadTimeout):
        session.get(urls["vm-1"] + SE, params={"api-version": V}, headers={"Metadata": "true"}, timeout=0.2)
    assert get(session, urls["vm-1"]).status_code == 200


def test_a_hanging_request_is_answered_once_the_fault_is_cleared(make, session):
    """clear_faults releases requests that are hanging."""
    emu, urls = make()
    emu.add_fault(kind="hang")
    answers: list[int] = []
    t = threading.Thread(target=lambda: answers.append(get(session, urls["vm-1"]).status_code))
    t.start()
    wait_for(lambda: emu.requests(), "the request to arrive")
    assert answers == []
    emu.clear_faults()
    t.join(5)
    assert answers == [200]


def test_add_fault_refuses_bad_parameters(make):
    """Clear errors naming the parameter."""
    emu, _ = make()
    for kwargs, message in (({"kind": "explode"}, "kind"), ({"status": 200}, "status"), ({"vm": "vm-9"}, "vm"),
                            ({"count": 0}, "count"), ({"duration": -1}, "duration"), ({"path": "x"}, "path")):
        with pytest.raises(ValueError, match=f"^{message}:"):
            emu.add_fault(**kwargs)


# --- admin API -------------------------------------------------------------------------------

def test_admin_api_drives_events_faults_and_reads_the_record(make, session):
    """JSON in and out, no Metadata header needed, for loopback clients."""
    emu, urls = make(("vm-1", "vm-2"))
    admin = urls["vm-1"] + "/admin/"
    created = session.post(admin + "events", json={"event_type": "Freeze", "resources": ["vm-2"], "notice": 60,
                                                    "duration_seconds": 5}, timeout=5)
    assert created.status_code == 201
    eid = created.json()["EventId"]
    assert emu.document("vm-2")["Events"][0]["EventType"] == "Freeze"
    assert session.post(admin + f"events/{eid}/start", timeout=5).json()["Events"][0]["EventStatus"] == "Started"
    assert session.post(admin + f"events/{eid}/complete", timeout=5).json()["Events"] == []
    other = emu.add_event(resources=["vm-1"])
    assert session.post(admin + f"events/{other}/cancel", timeout=5).status_code == 200
    missing = session.post(admin + f"events/{other}/start", timeout=5)
    assert missing.status_code == 404 and other in missing.json()["error"]

    assert session.post(admin + "faults", json={"kind": "status", "status": 503, "count": 1}, timeout=5).json() == \
        {"faults": 1}
    assert get(session, urls["vm-1"]).status_code == 503
    assert session.delete(admin + "faults", timeout=5).json() == {"faults": 0}
    approve(session, urls["vm-1"], "A")
    record = session.get(admin + "requests", timeout=5).json()
    assert [(r["method"], r["status"]) for r in record] == [("GET", 503), ("POST", 200)]
    assert session.get(admin + "approvals", timeout=5).json()[0]["event_ids"] == ["A"]
    assert session.get(urls["vm-2"] + "/admin/approvals", timeout=5).json() == []
    assert session.post(admin + "reset", timeout=5).json() == {"DocumentIncarnation": 1, "Events": []}


@pytest.mark.parametrize("method, route, body, status, error", [
    ("POST", "events", {"type": "Reboot"}, 400, "type: unknown parameter"),
    ("POST", "events", {"notice": -1}, 400, "notice"),
    ("POST", "events", [1], 400, "JSON object"),
    ("POST", "faults", {"kind": "nope"}, 400, "kind:"),
    ("GET", "nothing", None, 404, "no admin route"),
])
def test_admin_api_errors_name_the_problem(make, session, method, route, body, status, error):
    """Bad input is a 400 naming the key; an unknown route a 404."""
    _, urls = make()
    r = session.request(method, urls["vm-1"] + "/admin/" + route, json=body, timeout=5)
    assert r.status_code == status and error in r.json()["error"]


# --- server life -----------------------------------------------------------------------------

def test_stop_closes_kept_alive_and_hanging_connections_promptly(clock, session):
    """stop() returns quickly and leaves no connection serving."""
    emu = Emulator(["vm-1"], clock=clock)
    urls = emu.start()
    assert get(session, urls["vm-1"]).status_code == 200
    emu.add_fault(kind="hang")
    hung: list[type[BaseException]] = []

    def hang() -> None:
        try:
            get(requests.Session(), urls["vm-1"])
        except requests.RequestException as exc:
            hung.append(type(exc))

    t = threading.Thread(target=hang)
    t.start()
    wait_for(lambda: len(emu.requests()) == 2, "the hanging request")
    t0 = time.monotonic()
    emu.stop()
    t.join(5)
    assert time.monotonic() - t0 < 2 and hung == [requests.ConnectionError]
    with pytest.raises(requests.ConnectionError):
        get(session, urls["vm-1"])


def test_a_listener_hears_every_state_change(clock):
    """Stable event names for the CLI's log lines."""
    heard: list[str] = []
    emu = Emulator(["vm-1"], clock=clock, listener=lambda name, fields: heard.append(name))
    eid = emu.add_event(notice=10)
    emu.model.approve("vm-1", [eid])
    clock.advance(10)
    emu.tick()
    emu.add_fault(kind="latency")
    emu.clear_faults()
    emu.reset_incarnation()
    assert heard == ["emulator.event_created", "emulator.approval", "emulator.event_started",
                     "emulator.event_completed", "emulator.fault_added", "emulator.faults_cleared", "emulator.reset"]


# --- CLI -------------------------------------------------------------------------------------

def test_cli_prints_one_ready_line_serves_and_exits_0_on_sigterm(tmp_path):
    """`python -m agent.emulator`: ready line on stdout, JSON log lines on stderr, SIGTERM → exit 0."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text("events:\n  - {at: 0, type: Redeploy, resources: [b], notice: 600, id: SCENARIO-1}\n")
    proc = subprocess.Popen([sys.executable, "-m", "agent.emulator", "--vm", "a", "--vm", "b", "--rate-limit", "0",
                             "--scenario", str(scenario)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready_line = select.poll()  # not select(): a long run holds descriptors over 1023
        ready_line.register(proc.stdout, select.POLLIN)
        assert ready_line.poll(10_000), "no ready line"
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "emulator.ready" and sorted(ready["vms"]) == ["a", "b"]
        s = requests.Session()
        s.trust_env = False
        (event,) = wait_for(lambda: events(s, ready["vms"]["a"]), "the scenario's event")
        assert (event["EventId"], event["Resources"]) == ("SCENARIO-1", ["b"])
        assert approve(s, ready["vms"]["b"], "SCENARIO-1").status_code == 200
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out == ""
    logged = [json.loads(line) for line in err.splitlines()]
    assert [e["event"] for e in logged if e["event"].startswith("emulator.event")] == \
        ["emulator.event_created", "emulator.event_started"]
    assert any(e["event"] == "scenario.step" and e["event_id"] == "SCENARIO-1" for e in logged)


def test_cli_refuses_a_bad_scenario_naming_the_key(tmp_path, capsys):
    """Exit 2 and `file: events[0].notice: ...` on stderr, before listening."""
    from agent.emulator.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("events:\n  - {type: Reboot, notice: soon}\n")
    assert main(["--scenario", str(bad)]) == 2
    assert f"{bad}: events[0].notice: expected seconds >= 0" in capsys.readouterr().err
