"""The `alertmanager` handler on a frozen clock against `responses`: matchers refused at config load with
file:line and the fix, placeholders expanded (escaped in a regex), the silence's start and end, extension
while the event lasts, retries within the timeout, credentials, and what an operator sees of a failure."""

from __future__ import annotations

import base64
import json
import os
import threading
from datetime import UTC, datetime, timedelta

import pytest
import responses
from responses import matchers

from agent.clock import FakeClock
from agent.config.config import load, loads
from agent.errors import ConfigError
from agent.handlers.base import FAILED, OK, Context, Services, Settings
from agent.handlers.registry import instantiate
from agent.handlers.silences import expand
from agent.health.health_store import HealthStore
from agent.health.rotation import Rotation
from agent.model.events import Event
from agent.model.tracker import Tracked
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics

NOW = datetime(2026, 11, 22, 13, 0, tzinfo=UTC)
EVENT_ID = "A1B2C3D4-0000-4000-8000-000000000001"
AM = "http://am-0.invalid:9093"
SILENCES = f"{AM}/api/v2/silences"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=NOW)


@pytest.fixture
def svc(tmp_path, clock) -> Services:
    store = Store(tmp_path / "state", clock)
    health = HealthStore(clock)
    return Services(clock=clock, store=store, metrics=Metrics(), rotation=Rotation(store, health, ["*"]),
                    health=health, settings=Settings(vm_name="web-1", computer_name="web000001"))


def handler(svc: Services, extra: str = "", matcher: str = 'instance=~"{computer_name}(:[0-9]+)?"'):
    cfg = loads("handlers:\n  - {name: silence, type: alertmanager, phases: [scheduled, started, completed], "
                f"urls: ['{AM}'], matchers: ['{matcher}'], margin: 10m{extra}}}\n")
    return instantiate(cfg.handlers, svc)[0]


def reboot(duration: int = -1, status: str = "Scheduled") -> Event:
    return Event(event_id=EVENT_ID, event_type="Reboot", status=status, resources=("web-1",),
                 not_before=NOW + timedelta(minutes=15) if status == "Scheduled" else None, duration_seconds=duration)


def run(h, svc: Services, e: Event, phase: str = "scheduled", timeout: float = 60.0, outcome: str | None = None):
    svc.store.apply({e.event_id: Tracked(e, True, NOW, "", False)}, [])
    return h.run(Context(event=e, phase=phase, vm_name="web-1", names_self=True, timeout=timeout,
                         deadline=e.not_before, dry_run=False, clock=svc.clock, cancel=threading.Event(),
                         settings=svc.settings, outcome=outcome))


def posted(i: int = -1) -> dict:
    return json.loads([c for c in responses.calls if c.request.method == "POST"][i].request.body)


def no_silences_yet() -> None:
    responses.add(responses.GET, SILENCES, json=[])


@pytest.mark.parametrize(("matcher", "problem"), [
    ('instance ~ x', "is not a matcher"),
    ('instance=~"web("', "not a valid regex"),
    ('instance=~"(?!web)"', "lookarounds"),
    ('instance="{computer}"', "unknown placeholder {computer} (did you mean 'computer_name'?)"),
    ('instance=~".*"', "every matcher matches an absent label"),
    ('instance="a"b"', "text after the closing quote"),
])
def test_a_bad_matcher_is_refused_at_load_naming_file_line_key_and_the_fix(write_config, matcher, problem):
    path = write_config("handlers:\n  - name: silence\n    type: alertmanager\n    phases: [scheduled]\n"
                        f"    urls: ['{AM}']\n    matchers:\n      - '{matcher}'\n")
    with pytest.raises(ConfigError) as err:
        load(path)
    text = str(err.value)
    line = 6 if "absent" in problem else 7  # the whole list, or the one matcher
    assert f"{path}:{line}" in text and "handlers[0].matchers" in text and problem in text


@pytest.mark.parametrize(("extra", "key"), [
    (", comment: 'maintenance of {vm}'", "comment"),
    (", token_file: /a, basic_auth_file: /b", "basic_auth_file"),
    (", recheck: 6m", "recheck"),
    (", urls: ['http://user:pw@am:9093']", r"urls\[0\].*basic_auth_file"),
])
def test_other_bad_keys_are_refused(extra, key):
    with pytest.raises(ConfigError, match=key):
        loads("handlers:\n  - {name: s, type: alertmanager, phases: [scheduled], matchers: ['job=\"node\"'], "
              f"urls: ['{AM}']{extra}}}\n".replace(f"urls: ['{AM}'], urls", "urls"))


@responses.activate
def test_the_silence_names_the_event_expands_placeholders_and_runs_from_not_before_to_the_end_plus_margin(svc):
    no_silences_yet()
    responses.add(responses.POST, SILENCES, json={"silenceID": "s-1"})
    h = handler(svc, matcher='instance=~"{computer_name}.prod(:[0-9]+)?"')
    assert h.spec.on_failure == "continue"
    result = run(h, svc, reboot(duration=300))
    body = posted()
    assert body["matchers"] == [{"name": "instance", "value": "web000001.prod(:[0-9]+)?", "isRegex": True,
                                 "isEqual": True}]
    assert body["createdBy"] == "maintd@web-1" and body["comment"] == f"Azure Reboot {EVENT_ID} of web-1 (maintd)"
    assert body["startsAt"] == "2026-11-22T13:15:00Z", "pending until the VM leaves rotation or the event starts"
    assert body["endsAt"] == "2026-11-22T13:30:00Z"  # NotBefore + 300 s + 10m
    assert result.outcome == OK and "s-1" in result.detail and "2026-11-22T13:30:00Z" in result.detail
    note = svc.store.result(EVENT_ID, "note:silence")
    assert note["silences"][AM] == {"id": "s-1", "starts_at": "2026-11-22T13:15:00Z", "ends_at": "2026-11-22T13:30:00Z"}


def test_a_placeholder_is_escaped_in_a_regex_and_other_braces_stay():
    fields = {"vm": "a.b+c", "event_id": "E"}
    assert expand(r"{vm}(:[0-9]{1,5})?\p{L}", fields, regex=True) == r"a\.b\+c(:[0-9]{1,5})?\p{L}"
    assert expand("{vm}", fields) == "a.b+c"


@responses.activate
def test_an_unknown_duration_takes_the_types_default_and_an_equality_value_is_not_escaped(svc):
    no_silences_yet()
    responses.add(responses.POST, SILENCES, json={"silenceID": "s-1"})
    run(handler(svc, matcher='node="{vm}.x"'), svc, reboot())
    assert posted()["matchers"][0]["value"] == "web-1.x"
    assert posted()["endsAt"] == "2026-11-22T13:40:00Z"  # NotBefore + Reboot's 15 min + 10m


@responses.activate
def test_while_the_event_lasts_the_silence_is_extended_and_starts_when_the_vm_leaves_rotation(svc, clock):
    no_silences_yet()
    responses.add(responses.POST, SILENCES, json={"silenceID": "s-1"})
    h = handler(svc)
    e = reboot(duration=300)
    run(h, svc, e)
    silence = {"id": "s-1", "status": {"state": "pending"}, "startsAt": "2026-11-22T13:15:00.000Z",
               "endsAt": "2026-11-22T13:30:00.000Z"}
    responses.add(responses.GET, f"{AM}/api/v2/silence/s-1", json=silence)
    responses.add(responses.POST, SILENCES, json={"silenceID": "s-2"})
    clock.advance(5)
    svc.rotation.drain(f"event:{EVENT_ID}", "Reboot", clock.now())
    assert h.keep() == 1.0
    assert posted()["id"] == "s-1" and posted()["startsAt"] == "2026-11-22T13:00:05Z"
    assert svc.store.result(EVENT_ID, "note:silence")["silences"][AM]["id"] == "s-2", "Alertmanager replaced it"

    clock.advance(40 * 60)  # the event overran its expected end: still there
    active = {**silence, "id": "s-2", "status": {"state": "active"}, "startsAt": "2026-11-22T13:00:05.000Z"}
    responses.add(responses.GET, f"{AM}/api/v2/silence/s-2", json=active)
    responses.add(responses.POST, SILENCES, json={"silenceID": "s-2"})
    h.keep()
    assert posted()["id"] == "s-2" and posted()["startsAt"] == "2026-11-22T13:00:05Z", "an active one keeps its start"
    assert posted()["endsAt"] == "2026-11-22T13:50:05Z"  # now + margin


@responses.activate
def test_failures_are_retried_within_the_timeout_then_told_by_health_metric_and_log(svc, clock, logs):
    no_silences_yet()
    responses.add(responses.POST, SILENCES, status=503, body="busy")
    h = handler(svc)
    result = run(h, svc, reboot(), timeout=10.0)
    posts = [c for c in responses.calls if c.request.method == "POST"]
    assert 3 <= len(posts) <= 6 and clock.monotonic() - 1000 <= 10.0
    assert result.outcome == FAILED and "am-0.invalid" in result.detail and "503" in result.detail
    (report,) = [r for r in svc.health.to_json()["HealthEvents"] if r["Property"] == "silence/silences"]
    assert report["HealthState"] == "Warning"
    assert svc.metrics.silence_failures.labels("silence")._value.get() == 1
    assert [e["url"] for e in logs if e["event"] == "silence.failed"] == ["http://am-0.invalid"]

    responses.replace(responses.POST, SILENCES, json={"silenceID": "s-9"})
    clock.advance(31)
    h.keep()
    assert not [r for r in svc.health.to_json()["HealthEvents"] if r["Property"] == "silence/silences"]
    assert svc.store.result(EVENT_ID, "note:silence")["silences"][AM]["id"] == "s-9"


@responses.activate
def test_the_token_and_basic_auth_files_are_sent_and_an_unsafe_one_is_a_failure_naming_the_fix(svc, tmp_path):
    token = tmp_path / "am.token"
    token.write_text("s3cret\n")
    os.chmod(token, 0o600)
    bearer = [matchers.header_matcher({"Authorization": "Bearer s3cret"})]
    responses.add(responses.GET, SILENCES, json=[], match=bearer)
    responses.add(responses.POST, SILENCES, json={"silenceID": "s-1"}, match=bearer)
    assert run(handler(svc, f", token_file: {token}"), svc, reboot()).outcome == OK

    basic = tmp_path / "am.basic"
    basic.write_text("maintd:pw\n")
    os.chmod(basic, 0o644)
    result = run(handler(svc, f", basic_auth_file: {basic}"), svc, reboot(), timeout=2.0)
    assert result.outcome == FAILED and "chmod 600" in result.detail
    os.chmod(basic, 0o600)
    expected = "Basic " + base64.b64encode(b"maintd:pw").decode()
    pending = {"id": "s-1", "status": {"state": "pending"}, "startsAt": "2026-11-22T13:15:00Z",
               "endsAt": "2026-11-22T13:40:00Z"}
    basic_auth = [matchers.header_matcher({"Authorization": expected})]
    responses.add(responses.GET, f"{AM}/api/v2/silence/s-1", json=pending, match=basic_auth)
    responses.add(responses.POST, SILENCES, json={"silenceID": "s-2"}, match=basic_auth)
    assert run(handler(svc, f", basic_auth_file: {basic}"), svc, reboot(status="Started")).outcome == OK
    assert posted()["id"] == "s-1" and posted()["startsAt"] == "2026-11-22T13:00:00.500Z", "started: active now"
