"""The `health` handler: phases become reports in maintd's health store (and so on the probe), and
the same reports reach a Service Fabric cluster's REST endpoint with the client certificate."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
import requests
import responses
from responses import matchers

from agent.clock import FakeClock
from agent.config.config import loads
from agent.errors import ConfigError
from agent.handlers.base import FAILED, OK, Context
from agent.handlers.health_report import iso_duration
from agent.handlers.registry import instantiate
from agent.health.health_store import HealthState, HealthStore
from agent.health.rotation import Rotation
from agent.model.events import Event
from agent.state.state_store import Store

NOW = datetime(2026, 11, 22, 13, 56, tzinfo=UTC)
EVENT_ID = "A1B2C3D4-0000-4000-8000-000000000001"
PROP = f"maintenance/{EVENT_ID}"
SF = "https://sf.example.invalid:19080"
REPORT = f"{SF}/Nodes/vm-3/$/ReportHealth"
QUERY = matchers.query_param_matcher({"api-version": "6.0", "Immediate": "true"})


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=NOW)


@pytest.fixture
def make(clock):
    """Build a health handler from one `handlers:` entry, with its own local health store."""

    def build(yaml_item: str):
        cfg = loads(f"handlers:\n  - {yaml_item}\n")
        services = SimpleNamespace(clock=clock, health=HealthStore(clock))
        return instantiate(cfg.handlers, services)[0]

    return build


def context(clock, phase="scheduled", *, outcome=None, timeout=30.0, gone=False) -> Context:
    e = Event(event_id=EVENT_ID, event_type="Reboot", status="Started" if phase == "started" else "Scheduled",
              resources=("vm-3", "vm-4"), not_before=NOW + timedelta(minutes=9) if phase == "scheduled" else None,
              description="Host server is undergoing maintenance.", source="Platform", duration_seconds=-1)
    ctx = Context(event=e, phase=phase, vm_name="vm-3", names_self=True, timeout=timeout, deadline=e.not_before,
                  dry_run=False, clock=clock, cancel=threading.Event(), outcome=outcome)
    if gone:
        ctx.cancel.set()
    return ctx


def local(h) -> dict[tuple[str, str], tuple[HealthState, str]]:
    return {(ev.report.source_id, ev.report.property): (ev.report.state, ev.report.description)
            for ev in h.services.health.snapshot()}


# --- the local health store ----------------------------------------------------------------------

def test_a_report_for_an_event_already_gone_is_not_left_behind(make, clock):
    """The event left while the scheduled report was being made (completed may have run): no report stays."""
    h = make("{name: report, type: health, phases: [scheduled, completed]}")
    assert h.run(context(clock, gone=True)).outcome == "canceled"
    assert local(h) == {}


def test_phases_become_warning_then_error_then_nothing_in_the_local_store(make, clock):
    """scheduled → Warning, started → Error (started_state: Error), completed → the report is gone."""
    h = make("{name: report, type: health, phases: [scheduled, started, completed], started_state: Error}")
    assert h.run(context(clock)).outcome == OK
    assert local(h) == {("maintd", PROP): (HealthState.WARNING, f"Reboot {EVENT_ID} scheduled, not before "
                                                                "2026-11-22 14:05 UTC: Host server is undergoing "
                                                                "maintenance.")}
    result = h.run(context(clock, "started"))
    assert (result.outcome, result.detail) == (OK, "Error reported")
    assert local(h) == {("maintd", PROP): (HealthState.ERROR, f"Reboot {EVENT_ID} started: Host server is "
                                                              "undergoing maintenance.")}
    assert h.run(context(clock, "completed", outcome="completed")).detail == "report removed"
    assert local(h) == {}


def test_started_is_warning_by_default(make, clock):
    """Without started_state the Started phase stays Warning."""
    h = make("{name: report, type: health, phases: [scheduled, started]}")
    h.run(context(clock))
    h.run(context(clock, "started"))
    assert [state for state, _ in local(h).values()] == [HealthState.WARNING]


def test_the_reports_put_the_vm_out_of_rotation_only_as_probe_fail_on_allows(make, clock, tmp_path):
    """With the default probe.fail_on (which excludes maintd) rotation is the drain handler's alone; an
    operator who admits maintd's reports sees a started Error take the VM out of rotation."""
    h = make("{name: report, type: health, phases: [scheduled, started], started_state: Error}")
    health = h.services.health
    store = Store(tmp_path / "state", clock)
    default = Rotation(store, health, loads("").probe.fail_on)
    admitted = Rotation(store, health, ("*", "!imds"))
    h.run(context(clock))
    assert default.verdict().in_rotation and admitted.verdict().in_rotation
    h.run(context(clock, "started"))
    assert default.verdict().in_rotation
    assert not admitted.verdict().in_rotation and "maintenance/" + EVENT_ID in admitted.verdict().reason


# --- the Service Fabric push ---------------------------------------------------------------------

@responses.activate
def test_each_phase_is_pushed_to_service_fabric_with_the_client_certificate(make, clock):
    """POST /Nodes/{node}/$/ReportHealth?api-version=6.0&Immediate=true with a HealthInformation body,
    the client certificate and key, and the cluster CA; completed sends an Ok that removes itself."""
    for _ in range(3):
        responses.add(responses.POST, REPORT, status=200, match=[QUERY])
    h = make(f'{{name: report, type: health, phases: [scheduled, started, completed], started_state: Error, '
             f'cluster_url: "{SF}/", ttl: 30m, client_cert: /etc/maintd/sf.pem, client_key: /etc/maintd/sf.key, '
             'ca_cert: /etc/maintd/sf-ca.pem}')
    assert h.run(context(clock)).outcome == OK
    clock.advance(60)
    assert h.run(context(clock, "started")).outcome == OK
    clock.advance(600)
    assert h.run(context(clock, "completed", outcome="canceled")).outcome == OK
    bodies = [json.loads(c.request.body) for c in responses.calls]
    assert len(bodies) == 3, "one push per phase"
    seqs = [int(b.pop("SequenceNumber")) for b in bodies]
    ms = int(NOW.timestamp() * 1000)
    assert seqs[0] >= ms and seqs[1] >= ms + 60_000 and seqs[2] >= ms + 660_000 and seqs == sorted(set(seqs)), \
        "SequenceNumbers are milliseconds since the epoch (or more), strictly increasing"
    assert bodies[0] == {"SourceId": "maintd", "Property": PROP, "HealthState": "Warning",
                         "Description": f"Reboot {EVENT_ID} scheduled, not before 2026-11-22 14:05 UTC: "
                                        "Host server is undergoing maintenance.",
                         "TimeToLiveInMilliSeconds": "PT30M", "RemoveWhenExpired": True}
    assert bodies[1]["HealthState"] == "Error"
    assert bodies[2] == {"SourceId": "maintd", "Property": PROP, "HealthState": "Ok",
                         "Description": f"Reboot {EVENT_ID} canceled", "TimeToLiveInMilliSeconds": "PT1M",
                         "RemoveWhenExpired": True}
    for call in responses.calls:
        assert call.request.req_kwargs["cert"] == ("/etc/maintd/sf.pem", "/etc/maintd/sf.key")
        assert call.request.req_kwargs["verify"] == "/etc/maintd/sf-ca.pem"
        assert call.request.headers["Content-Type"] == "application/json"


@responses.activate
def test_without_ttl_a_pushed_report_lasts_until_replaced(make, clock):
    """No ttl: no TimeToLive in the body, and RemoveWhenExpired false (it never expires)."""
    responses.add(responses.POST, REPORT, status=200, match=[QUERY])
    h = make(f'{{name: report, type: health, phases: [scheduled], cluster_url: "{SF}", client_cert: /etc/c.pem, '
             'verify: false}')
    assert h.run(context(clock)).outcome == OK
    body = json.loads(responses.calls[0].request.body)
    assert "TimeToLiveInMilliSeconds" not in body and body["RemoveWhenExpired"] is False
    assert responses.calls[0].request.req_kwargs["cert"] == "/etc/c.pem"
    assert responses.calls[0].request.req_kwargs["verify"] is False


@responses.activate
def test_node_name_overrides_the_vm_name_and_is_quoted(make, clock):
    """Service Fabric node names differ from VM names (`_nt1vm_0`); odd characters are escaped in the path."""
    responses.add(responses.POST, f"{SF}/Nodes/_nt1vm_0%2Fa%20b/$/ReportHealth", status=200, match=[QUERY])
    h = make(f'{{name: report, type: health, phases: [scheduled], cluster_url: "{SF}", node_name: "_nt1vm_0/a b"}}')
    assert h.run(context(clock)).outcome == OK


@responses.activate
def test_sequence_numbers_keep_increasing_even_within_one_millisecond(make, clock):
    """Two reports at the same instant still get strictly increasing SequenceNumbers (SF refuses stale ones)."""
    responses.add(responses.POST, REPORT, status=200)
    h = make(f'{{name: report, type: health, phases: [scheduled, started], cluster_url: "{SF}"}}')
    h.run(context(clock))
    h.run(context(clock, "started"))
    h.run(context(clock, "started"))
    seqs = [int(json.loads(c.request.body)["SequenceNumber"]) for c in responses.calls]
    assert seqs[0] >= int(NOW.timestamp() * 1000) and seqs == sorted(set(seqs))


@responses.activate
def test_a_refused_push_fails_the_run_but_keeps_the_local_report(make, clock):
    """403 from the cluster: failed with the answer, not retried; the local Warning stands."""
    responses.add(responses.POST, REPORT, status=403, body='{"Error": {"Code": "FABRIC_E_UNAUTHORIZED"}}')
    h = make(f'{{name: report, type: health, phases: [scheduled], cluster_url: "{SF}"}}')
    result = h.run(context(clock))
    assert result.outcome == FAILED and len(responses.calls) == 1
    assert result.detail.startswith("Service Fabric https://sf.example.invalid answered 403:")
    assert "FABRIC_E_UNAUTHORIZED" in result.detail
    assert [state for state, _ in local(h).values()] == [HealthState.WARNING]


@responses.activate
def test_a_busy_cluster_is_retried(make, clock):
    """503 then 200: pushed on the second try, with the same SequenceNumber."""
    responses.add(responses.POST, REPORT, status=503)
    responses.add(responses.POST, REPORT, status=200)
    h = make(f'{{name: report, type: health, phases: [scheduled], cluster_url: "{SF}"}}')
    assert h.run(context(clock)).outcome == OK
    assert len({c.request.body for c in responses.calls}) == 1 and len(responses.calls) == 2


@responses.activate
def test_an_unreachable_cluster_fails_after_three_tries_within_the_budget(make, clock):
    """Connection refused three times: failed, naming the error type; the waits fit the run's timeout."""
    responses.add(responses.POST, REPORT, body=requests.ConnectionError("refused"))
    h = make(f'{{name: report, type: health, phases: [completed], cluster_url: "{SF}"}}')
    t0 = clock.monotonic()
    result = h.run(context(clock, "completed", outcome="completed", timeout=10.0))
    assert result.outcome == FAILED and len(responses.calls) == 3
    assert result.detail == ("Service Fabric push to https://sf.example.invalid failed after 3 attempt(s): "
                             "ConnectionError")
    assert clock.monotonic() - t0 <= 10.0
    assert local(h) == {}, "the local report is removed whatever the cluster says"


@pytest.mark.parametrize("seconds, text", [
    (1800, "PT30M"), (60, "PT1M"), (1, "PT1S"), (0.5, "PT0.5S"), (86400, "P1D"), (90061, "P1DT1H1M1S"),
    (3600 * 30, "P1DT6H"), (61.25, "PT1M1.25S"), (0, "PT0S"),
])
def test_ttl_is_written_as_an_iso_8601_duration(seconds, text):
    """TimeToLiveInMilliSeconds is a duration string on the wire, written as .NET's XmlConvert writes it."""
    assert iso_duration(seconds) == text


@pytest.mark.parametrize("item, key", [
    ("{name: h, type: health, phases: [scheduled], started_state: Critical}", "handlers[0].started_state"),
    ("{name: h, type: health, phases: [scheduled], cluster_url: 'sf:19080'}", "handlers[0].cluster_url"),
    ("{name: h, type: health, phases: [scheduled], client_key: /k.pem}", "handlers[0].client_key"),
    ("{name: h, type: health, phases: [scheduled], ca_cert: /ca.pem, verify: false}", "handlers[0].verify"),
    ("{name: h, type: health, phases: [scheduled], client_cert: cert.pem}", "handlers[0].client_cert"),
    ("{name: h, type: health, phases: [scheduled], ttl: 0s}", "handlers[0].ttl"),
])
def test_bad_health_options_are_refused_naming_the_key(item, key):
    """States, URLs, certificate paths and TTLs are checked when the config loads."""
    with pytest.raises(ConfigError) as err:
        loads(f"handlers:\n  - {item}\n", "maintd.yaml")
    assert err.value.key == key and err.value.line == 2


def test_a_client_certificate_that_cannot_be_read_fails_the_run_naming_it(make, clock, tmp_path):
    """A missing PEM file is a failed run that names it (requests refuses before connecting)."""
    missing = tmp_path / "sf-client.pem"
    h = make(f'{{name: report, type: health, phases: [scheduled], cluster_url: "https://127.0.0.1:9", '
             f'client_cert: "{missing}"}}')
    result = h.run(context(clock))
    assert result.outcome == FAILED and str(missing) in result.detail
    assert [state for state, _ in local(h).values()] == [HealthState.WARNING]
