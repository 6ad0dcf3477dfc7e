"""The `webhook` handler against `responses`: preset bodies word for word on a frozen clock, templates,
url_file rotation, secrets kept out of logs and results, retries only where they can help, the budget."""

from __future__ import annotations

import email.utils
import json
import threading
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
import requests
import responses
from responses import matchers

from agent import __version__
from agent.clock import FakeClock
from agent.config.config import loads
from agent.errors import ConfigError
from agent.handlers.base import FAILED, OK, Context
from agent.handlers.registry import instantiate
from agent.model.events import Event
from agent.state.state_store import Store

NOW = datetime(2026, 11, 22, 13, 56, tzinfo=UTC)
EVENT_ID = "A1B2C3D4-0000-4000-8000-000000000001"
SECRET = "T0000/B0000/s3cr3tT0k3n"
HOOK_URL = f"https://hooks.example.invalid/services/{SECRET}"
OTHER_URL = "https://other.example.invalid/hook/rotated-secret"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=NOW)


@pytest.fixture
def make(tmp_path, clock):
    """Build a webhook handler from one `handlers:` entry; its services share `clock` and a real state store."""

    def build(yaml_item: str):
        cfg = loads(f"handlers:\n  - {yaml_item}\n")
        services = SimpleNamespace(clock=clock, store=Store(tmp_path / "state", clock))
        return instantiate(cfg.handlers, services)[0]

    return build


def context(clock, phase="scheduled", *, description="", outcome=None, approved_by=None, names_self=True,
            resources=("vm-3", "vm-4"), timeout=60.0) -> Context:
    e = Event(event_id=EVENT_ID, event_type="Reboot", status="Started" if phase == "started" else "Scheduled",
              resources=resources, not_before=NOW + timedelta(minutes=9) if phase == "scheduled" else None,
              description=description, source="Platform", duration_seconds=-1)
    return Context(event=e, phase=phase, vm_name="vm-3", names_self=names_self, timeout=timeout,
                   deadline=e.not_before, dry_run=False, clock=clock, cancel=threading.Event(), outcome=outcome,
                   approved_by=approved_by)


def sent(i: int = -1) -> dict:
    return json.loads(responses.calls[i].request.body)


# --- preset bodies -------------------------------------------------------------------------------

@responses.activate
def test_slack_posts_one_readable_line(make, clock):
    """The line names the type, the VM, NotBefore in UTC with a countdown, and who approved."""
    responses.add(responses.POST, HOOK_URL, status=200, body="ok",
                   match=[matchers.header_matcher({"Content-Type": "application/json",
                                                   "User-Agent": f"maintd/{__version__}"})])
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", preset: slack}}')
    result = h.run(context(clock, approved_by="vm-1"))
    assert result.outcome == OK and result.detail == "https://hooks.example.invalid answered 200"
    assert sent() == {"text": "Reboot of vm-3 not before 14:05 UTC (in 9 min), approved by vm-1"}


@responses.activate
def test_teams_posts_the_line_as_an_adaptive_card_message(make, clock):
    """Teams Workflows take Adaptive Cards only: the line is a TextBlock in a card attachment (and plain text)."""
    responses.add(responses.POST, HOOK_URL, status=202)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", preset: teams}}')
    assert h.run(context(clock, approved_by="vm-1")).outcome == OK
    line = "Reboot of vm-3 not before 14:05 UTC (in 9 min), approved by vm-1"
    assert sent() == {
        "type": "message",
        "text": line,
        "attachments": [{
            "contentType": "application/vnd.microsoft.card.adaptive",
            "contentUrl": None,
            "content": {"type": "AdaptiveCard", "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
                        "version": "1.4", "body": [{"type": "TextBlock", "text": line, "wrap": True}]},
        }],
    }


@pytest.mark.parametrize("phase, outcome, approved_by, description, line", [
    ("scheduled", None, None, "Host server is undergoing maintenance.",
     "Reboot of vm-3 not before 14:05 UTC (in 9 min) — Host server is undergoing maintenance."),
    ("started", None, "vm-1", "", "Reboot of vm-3 has started, approved by vm-1"),
    ("started", None, None, "", "Reboot of vm-3 has started"),
    ("completed", "completed", None, "", "Reboot of vm-3 is over"),
    ("completed", "canceled", None, "", "Reboot of vm-3 was canceled"),
])
@responses.activate
def test_each_phase_has_its_own_wording(make, clock, phase, outcome, approved_by, description, line):
    """scheduled / started / completed (or canceled) read differently; no approver, no 'approved by'."""
    responses.add(responses.POST, HOOK_URL, status=200)
    h = make(f'{{name: ops, type: webhook, phases: [{phase}], url: "{HOOK_URL}", preset: slack}}')
    assert h.run(context(clock, phase, description=description, outcome=outcome, approved_by=approved_by)).outcome == OK
    assert sent() == {"text": line}


@pytest.mark.parametrize("seconds_before, countdown", [
    (45, "in 45 s"), (89, "in 89 s"), (20 * 60, "in 20 min"), (3 * 3600, "in 3.0 h"), (0, "due now"), (-600, "due now"),
])
@responses.activate
def test_the_countdown_reads_in_seconds_minutes_or_hours(make, clock, seconds_before, countdown):
    """Short waits in seconds, then minutes, then hours; a NotBefore already reached reads 'due now'."""
    responses.add(responses.POST, HOOK_URL, status=200)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", preset: slack}}')
    ctx = context(clock)
    ctx.clock = FakeClock(start=ctx.event.not_before - timedelta(seconds=seconds_before))
    assert h.run(ctx).outcome == OK
    assert sent() == {"text": f"Reboot of vm-3 not before 14:05 UTC ({countdown})"}


@responses.activate
def test_an_event_for_other_vms_names_them_not_this_one(make, clock):
    """With `scope: any`, an event that does not name this VM is reported for the VMs it does name."""
    responses.add(responses.POST, HOOK_URL, status=200)
    h = make(f'{{name: ops, type: webhook, phases: [started], scope: any, url: "{HOOK_URL}", preset: slack}}')
    assert h.run(context(clock, "started", names_self=False, resources=("vm-7", "vm-8"))).outcome == OK
    assert sent() == {"text": "Reboot of vm-7, vm-8 has started"}


@responses.activate
def test_the_approver_is_read_from_the_state_store_when_this_vm_approved(make, clock):
    """When this VM sent the approval, the line says so (the coordinator's record is the source)."""
    responses.add(responses.POST, HOOK_URL, status=200)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", preset: slack}}')
    h.services.store.record(EVENT_ID, "approval", {"status": "sending", "by": "vm-3"})
    h.run(context(clock))
    assert sent()["text"].endswith("(in 9 min)"), "an approval not yet sent is not claimed"
    h.services.store.record(EVENT_ID, "approval", {"status": "sent", "by": "vm-3"})
    h.run(context(clock))
    assert sent()["text"].endswith("(in 9 min), approved by vm-3")


@responses.activate
def test_generic_posts_exactly_the_payload_hooks_get_on_stdin(make, clock):
    """The generic body is ctx.payload(): phase, VM, outcome and the event in IMDS field names."""
    responses.add(responses.POST, HOOK_URL, status=204)
    h = make(f'{{name: ops, type: webhook, phases: [completed], url: "{HOOK_URL}"}}')
    ctx = context(clock, "completed", outcome="canceled")
    assert h.run(ctx).outcome == OK
    assert sent() == json.loads(json.dumps(ctx.payload())) and sent()["outcome"] == "canceled"
    assert sent()["event"]["EventId"] == EVENT_ID


# --- templates -----------------------------------------------------------------------------------

@responses.activate
def test_a_json_template_stays_valid_json_whatever_the_event_says(make, clock):
    """Quotes, backslashes and newlines in a Description are escaped inside a JSON template."""
    responses.add(responses.POST, HOOK_URL, status=200,
                  match=[matchers.header_matcher({"Content-Type": "application/json", "X-Team": "sre"})])
    h = make(f'{{name: t, type: webhook, phases: [scheduled], url: "{HOOK_URL}", headers: {{X-Team: sre}}, '
             'template: \'{{"id": "{event_id}", "vm": "{vm}", "why": "{description}", "msg": "{text}"}}\'}')
    tricky = 'he said "reboot" \\ now\nand {event_id}'
    assert h.run(context(clock, description=tricky)).outcome == OK
    body = sent()
    assert body == {"id": EVENT_ID, "vm": "vm-3", "why": tricky,
                    "msg": f"Reboot of vm-3 not before 14:05 UTC (in 9 min) — {tricky}"}


@responses.activate
def test_a_text_template_is_sent_as_text(make, clock):
    """A template that is not JSON goes out as text/plain with the values as they are."""
    responses.add(responses.POST, HOOK_URL, status=200,
                   match=[matchers.header_matcher({"Content-Type": "text/plain; charset=utf-8"})])
    h = make(f'{{name: t, type: webhook, phases: [scheduled], url: "{HOOK_URL}", '
             'template: "maintenance {event_type} on {resources} at {not_before} ({phase}): \\"{description}\\""}')
    assert h.run(context(clock, description='say "hi"')).outcome == OK
    assert responses.calls[0].request.body == \
        b'maintenance Reboot on vm-3,vm-4 at 2026-11-22T14:05:00Z (scheduled): "say "hi""'


@pytest.mark.parametrize("template, says", [
    ("'{event_id.__class__}'", "unknown field {event_id.__class__}"),
    ("'{event_id[0]}'", "unknown field {event_id[0]}"),
    ("'{secret}'", "unknown field {secret}"),
    ("'{}'", "unknown field {}"),
    ("'{text:>{vm}}'", "cannot contain another field"),
    ("'{text:d}'", "not a valid template"),
    ("'{text'", "not a valid template"),
])
def test_templates_are_checked_when_the_config_loads(template, says):
    """Only the fixed fields, no attribute or index access, no format that could fail later."""
    with pytest.raises(ConfigError) as err:
        loads("handlers:\n  - {name: t, type: webhook, phases: [scheduled], url: 'http://x', "
              f"template: {template}}}\n")
    assert err.value.key == "handlers[0].template" and says in err.value.message


# --- url_file and secrets ------------------------------------------------------------------------

@responses.activate
def test_url_file_is_read_at_every_run_so_a_rotated_url_is_used(make, clock, tmp_path):
    """Rewrite the file between runs: the second POST goes to the new URL, no reload needed."""
    url_file = tmp_path / "slack-url"
    url_file.write_text(HOOK_URL + "\n")
    responses.add(responses.POST, HOOK_URL, status=200)
    responses.add(responses.POST, OTHER_URL, status=200)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url_file: "{url_file}", preset: slack}}')
    assert h.run(context(clock)).outcome == OK
    url_file.write_text(OTHER_URL)
    assert h.run(context(clock)).outcome == OK
    assert [c.request.url for c in responses.calls] == [HOOK_URL, OTHER_URL]


@pytest.mark.parametrize("content, says", [(None, "cannot be read: No such file or directory"),
                                           ("not a url", "does not hold one http(s) URL"),
                                           (f"{HOOK_URL}\n{OTHER_URL}", "does not hold one http(s) URL")])
@responses.activate
def test_an_unusable_url_file_fails_the_run_without_quoting_it(make, clock, tmp_path, content, says):
    """A missing or garbled url_file is a failed run naming the file, never its content."""
    url_file = tmp_path / "url"
    if content is not None:
        url_file.write_text(content)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url_file: "{url_file}"}}')
    result = h.run(context(clock))
    assert result.outcome == FAILED and says in result.detail and str(url_file) in result.detail
    assert SECRET not in result.detail and not responses.calls


@responses.activate
def test_a_url_file_another_user_could_replace_is_refused(make, clock, tmp_path):
    """A url_file in a group-writable directory: another user could point the webhook, and its secret headers, at
    their host. Refused at load naming the directory and the fix; made so after the load, the run fails and
    nothing is sent (issue 28, LOW 7: paths checked like sshd's StrictModes)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    url_file = shared / "url"
    url_file.write_text(HOOK_URL)
    item = f'{{name: ops, type: webhook, phases: [scheduled], url_file: "{url_file}", headers: {{X-Api-Key: k}}}}'
    shared.chmod(0o770)
    with pytest.raises(ConfigError, match=f"url_file: {shared} is writable by group or others .*chmod go-w {shared}"):
        make(item)
    shared.chmod(0o755)
    h = make(item)
    shared.chmod(0o777)
    result = h.run(context(clock))
    assert result.outcome == FAILED and f"chmod go-w {shared}" in result.detail and not responses.calls


@responses.activate
def test_secrets_never_reach_logs_or_results(make, clock, tmp_path, logs):
    """Connection errors quote the URL in their text; maintd logs and records only scheme://host."""
    url_file = tmp_path / "url"
    url_file.write_text(HOOK_URL)
    responses.add(responses.POST, HOOK_URL, body=requests.ConnectionError(f"Max retries exceeded with url: {HOOK_URL}"))
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url_file: "{url_file}", retries: 1, '
             'headers: {Authorization: Bearer t0p-s3cret}}')
    result = h.run(context(clock))
    assert result.outcome == FAILED
    assert result.detail == "https://hooks.example.invalid: ConnectionError after 2 attempts"
    failed = [e for e in logs if e["event"] == "webhook.failed"]
    assert failed and failed[0]["target"] == "https://hooks.example.invalid" and failed[0]["attempts"] == 2
    everything = json.dumps(logs, default=str) + result.detail + result.output
    assert SECRET not in everything and "s3cret" not in everything and "t0p" not in everything


# --- retries and time ----------------------------------------------------------------------------

@responses.activate
def test_503_is_retried_with_backoff_until_it_succeeds(make, clock):
    """Two 503s then 200: three POSTs, ok, and the clock shows the backoff waits (exponential, jittered)."""
    for status in (503, 503, 200):
        responses.add(responses.POST, HOOK_URL, status=status)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", preset: slack}}')
    t0 = clock.monotonic()
    result = h.run(context(clock))
    assert result.outcome == OK and result.detail == "https://hooks.example.invalid answered 200 after 3 attempts"
    assert len(responses.calls) == 3 and len({c.request.body for c in responses.calls}) == 1
    assert 0.5 + 1.0 <= clock.monotonic() - t0 <= 1.0 + 2.0


@pytest.mark.parametrize("status", [400, 403, 404, 410])
@responses.activate
def test_a_4xx_is_not_retried(make, clock, status):
    """A refused request stays refused: one POST, failed, with the answer's first words."""
    responses.add(responses.POST, HOOK_URL, status=status, body="invalid_payload")
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", preset: slack}}')
    result = h.run(context(clock))
    assert result.outcome == FAILED and len(responses.calls) == 1
    assert result.detail == f"https://hooks.example.invalid answered {status}: invalid_payload"


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@responses.activate
def test_a_redirect_is_not_followed_so_secret_headers_stay_with_the_configured_host(make, clock, status):
    """A 3xx naming another host would get the body and the custom headers: one POST, failed, named."""
    responses.add(responses.POST, HOOK_URL, status=status, headers={"Location": "https://evil.example.invalid/collect"})
    responses.add(responses.POST, "https://evil.example.invalid/collect", status=200)
    responses.add(responses.GET, "https://evil.example.invalid/collect", status=200)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", preset: slack, '
             'headers: {X-Api-Key: s3cr3t}}')
    result = h.run(context(clock))
    assert result.outcome == FAILED
    assert [c.request.url for c in responses.calls] == [HOOK_URL]
    assert result.detail == f"https://hooks.example.invalid: answered {status}, a redirect (not followed)"


@responses.activate
def test_429_waits_as_long_as_retry_after_says(make, clock):
    """Slack's 429 carries Retry-After: the next try waits at least that long."""
    responses.add(responses.POST, HOOK_URL, status=429, headers={"Retry-After": "7"})
    responses.add(responses.POST, HOOK_URL, status=200)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", preset: slack}}')
    t0 = clock.monotonic()
    assert h.run(context(clock)).outcome == OK
    assert 7 <= clock.monotonic() - t0 < 8


@responses.activate
@pytest.mark.parametrize("value", ["²", "١٢", "1²", "soon"])
def test_a_retry_after_of_unicode_digits_is_ignored_and_the_retry_goes_on(make, clock, value):
    """`Retry-After: ²` passes str.isdigit and float() refuses it: the 429 is retried on the usual backoff and
    the run ends OK, never a ValueError out of the wait (issue 28, LOW 8)."""
    responses.add(responses.POST, HOOK_URL, status=429, headers={"Retry-After": value})
    responses.add(responses.POST, HOOK_URL, status=200)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", preset: slack}}')
    t0 = clock.monotonic()
    assert h.run(context(clock)).outcome == OK and len(responses.calls) == 2
    assert clock.monotonic() - t0 < 5


@responses.activate
def test_a_retry_after_http_date_is_honoured_like_imds_does(make, clock):
    """Retry-After as an HTTP-date 7 s ahead waits 7 s, as IMDS's client reads it: one parser for both."""
    when = email.utils.format_datetime(clock.now() + timedelta(seconds=7), usegmt=True)
    responses.add(responses.POST, HOOK_URL, status=503, headers={"Retry-After": when})
    responses.add(responses.POST, HOOK_URL, status=200)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", preset: slack}}')
    t0 = clock.monotonic()
    assert h.run(context(clock)).outcome == OK
    assert 7 <= clock.monotonic() - t0 < 8


@responses.activate
def test_retries_stop_after_the_configured_count(make, clock):
    """retries: 2 means three POSTs at most; the last answer is the result."""
    responses.add(responses.POST, HOOK_URL, status=502, body="bad gateway")
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", retries: 2}}')
    result = h.run(context(clock))
    assert len(responses.calls) == 3
    assert result.detail == "https://hooks.example.invalid answered 502 after 3 attempts: bad gateway"


@responses.activate
def test_retries_never_outlast_the_handlers_timeout(make, clock):
    """Against an endpoint that always answers 503, 20 retries end inside a 4 s budget, waits included."""
    responses.add(responses.POST, HOOK_URL, status=503)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", retries: 20}}')
    t0 = clock.monotonic()
    result = h.run(context(clock, timeout=4.0))
    assert result.outcome == FAILED and "answered 503" in result.detail
    assert clock.monotonic() - t0 <= 4.0
    assert 2 <= len(responses.calls) < 21
    timeouts = [c.request.req_kwargs["timeout"] for c in responses.calls]
    assert timeouts[0] == 4.0 and all(0.5 <= t <= 4.0 for t in timeouts), timeouts


@responses.activate
def test_a_request_timeout_is_retried_and_reported(make, clock):
    """A read timeout counts as transient; each request gets `request_timeout`, capped by the time left."""
    responses.add(responses.POST, HOOK_URL, body=requests.exceptions.ReadTimeout("read timed out"))
    responses.add(responses.POST, HOOK_URL, body=requests.exceptions.ReadTimeout("read timed out"))
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}", retries: 1, '
             'request_timeout: 2s}')
    result = h.run(context(clock))
    assert result.detail == "https://hooks.example.invalid: ReadTimeout after 2 attempts"
    assert [c.request.req_kwargs["timeout"] for c in responses.calls] == [2.0, 2.0]


@responses.activate
def test_a_tls_failure_is_not_retried(make, clock):
    """A certificate that does not verify will not verify on the next try either."""
    responses.add(responses.POST, HOOK_URL, body=requests.exceptions.SSLError("certificate verify failed"))
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}"}}')
    assert h.run(context(clock)).detail == "https://hooks.example.invalid: SSLError"
    assert len(responses.calls) == 1


@responses.activate
def test_webhooks_go_through_the_proxy_from_the_environment(make, clock, monkeypatch):
    """Unlike IMDS calls, a webhook honours HTTPS_PROXY (corporate egress)."""
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example.invalid:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    responses.add(responses.POST, HOOK_URL, status=200)
    h = make(f'{{name: ops, type: webhook, phases: [scheduled], url: "{HOOK_URL}"}}')
    assert h.run(context(clock)).outcome == OK
    assert responses.calls[0].request.req_kwargs["proxies"].get("https") == "http://proxy.example.invalid:3128"


@pytest.mark.parametrize("item, key", [
    ("{name: h, type: webhook, phases: [scheduled]}", "handlers[0].url"),
    ("{name: h, type: webhook, phases: [scheduled], url: 'https://a', url_file: /etc/maintd/url}", "handlers[0].url"),
    ("{name: h, type: webhook, phases: [scheduled], url: 'ftp://a'}", "handlers[0].url"),
    ("{name: h, type: webhook, phases: [scheduled], url_file: relative/url}", "handlers[0].url_file"),
    ("{name: h, type: webhook, phases: [scheduled], url: 'https://a', preset: discord}", "handlers[0].preset"),
    ("{name: h, type: webhook, phases: [scheduled], url: 'https://a', retries: 21}", "handlers[0].retries"),
    ("{name: h, type: webhook, phases: [scheduled], url: 'https://a', timeout_per_request: 1s}",
     "handlers[0].timeout_per_request"),
])
def test_bad_webhook_options_are_refused_naming_the_key(item, key):
    """Exactly one of url and url_file; known presets; bounded retries; typos caught."""
    with pytest.raises(ConfigError) as err:
        loads(f"handlers:\n  - {item}\n", "maintd.yaml")
    assert err.value.key == key and err.value.line == 2
