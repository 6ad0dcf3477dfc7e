"""The built-in exec, webhook and health handlers, with real subprocesses and `responses`."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
import responses

from agent.clock import SystemClock
from agent.config import loads
from agent.errors import ConfigError
from agent.events import Event
from agent.handlers.base import FAILED, OK, TIMED_OUT, Context
from agent.handlers.registry import instantiate
from agent.health import HealthState, HealthStore
from agent.state import Store

HOSTILE = "$(touch pwned); rm -rf ~ `touch pwned2` && echo ${HOME}"
NOW = datetime(2026, 11, 22, 13, 56, tzinfo=timezone.utc)


def handler(tmp_path, clock, yaml_item: str):
    cfg = loads(f"handlers:\n  - {yaml_item}\n")
    services = SimpleNamespace(config=cfg, clock=clock, store=Store(tmp_path / "state", clock),
                               health=HealthStore(clock), metrics=None, vm_name="vm-3", profile=None,
                               rotation=None)
    return instantiate(cfg.handlers, services)[0], services


def context(clock, phase="scheduled", timeout=10.0, description="Host server is undergoing maintenance.",
            outcome=None, not_before=NOW + timedelta(minutes=9)):
    e = Event(event_id="A1B2C3D4-0000-4000-8000-000000000001", event_type="Reboot", status="Scheduled",
              resources=("vm-3", "vm-4"), not_before=not_before, description=description, source="Platform",
              duration_seconds=-1)
    return Context(event=e, phase=phase, vm_name="vm-3", names_self=True, timeout=timeout, deadline=e.not_before,
                   dry_run=False, clock=clock, cancel=threading.Event(), outcome=outcome)


PY = sys.executable


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


# --- exec ----------------------------------------------------------------------------------------

def test_exec_passes_the_event_in_env_and_stdin_never_on_a_command_line(tmp_path):
    out = tmp_path / "seen.json"
    script = ("import json, os, sys; json.dump({'env': {k: v for k, v in os.environ.items()}, "
              "'stdin': json.load(sys.stdin), 'argv': sys.argv}, open(os.environ['OUT'], 'w'))")
    h, _ = handler(tmp_path, SystemClock(), f'{{name: hook, type: exec, phases: [scheduled], '
                                            f'command: ["{PY}", "-c", "{script}"], env: {{OUT: "{out}"}}, cwd: "{tmp_path}"}}')
    result = h.run(context(SystemClock(), description=HOSTILE))
    assert result.outcome == OK, result
    seen = json.loads(out.read_text())
    env = seen["env"]
    assert env["MAINTD_EVENT_ID"] == "A1B2C3D4-0000-4000-8000-000000000001"
    assert env["MAINTD_EVENT_TYPE"] == "Reboot" and env["MAINTD_EVENT_STATUS"] == "Scheduled"
    assert env["MAINTD_NOT_BEFORE"] == "2026-11-22T14:05:00Z"
    assert env["MAINTD_RESOURCES"] == "vm-3,vm-4" and env["MAINTD_VM_NAME"] == "vm-3"
    assert env["MAINTD_PHASE"] == "scheduled" and env["MAINTD_DURATION_SECONDS"] == "-1"
    assert env["MAINTD_EVENT_SOURCE"] == "Platform"
    assert env["MAINTD_DESCRIPTION"] == HOSTILE, "event text arrives verbatim, as data"
    assert seen["stdin"]["event"]["Description"] == HOSTILE and seen["stdin"]["phase"] == "scheduled"
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    assert "MAINTD_CI" not in env and "VIRTUAL_ENV" not in env, "maintd's own environment is not passed on"
    assert set(env) >= {"PATH", "HOME", "LANG"}


def test_exec_timeout_kills_the_whole_process_tree(tmp_path):
    pids = tmp_path / "pids"
    script = (f"import os, subprocess, time; child = subprocess.Popen(['sleep', '60']); "
              f"open('{pids}', 'w').write(f'{{os.getpid()}} {{child.pid}}'); time.sleep(60)")
    h, _ = handler(tmp_path, SystemClock(), f'{{name: slow, type: exec, phases: [scheduled], kill_grace: 1s, '
                                            f'command: ["{PY}", "-c", "{script}"]}}')
    t0 = time.monotonic()
    result = h.run(context(SystemClock(), timeout=1.0))
    assert result.outcome == TIMED_OUT and time.monotonic() - t0 < 10
    for pid in map(int, pids.read_text().split()):
        assert not alive(pid), f"process {pid} of the hook's tree survived the timeout"


def test_exec_output_is_bounded_and_logged(tmp_path, logs):
    script = "import sys; [sys.stdout.write('x' * 1023 + chr(10)) for _ in range(4096)]; print('last line')"
    h, _ = handler(tmp_path, SystemClock(), f'{{name: chatty, type: exec, phases: [scheduled], '
                                            f'command: ["{PY}", "-c", "{script}"]}}')
    result = h.run(context(SystemClock()))
    assert result.outcome == OK
    assert len(result.output) <= 64 * 1024 and result.output.rstrip().endswith("last line")
    logged = next(e for e in logs if e["event"] == "hook.output")
    assert logged["truncated_bytes"] > 3_000_000 and logged["lines"].endswith("last line")


def test_exec_failures_report_exit_code_and_missing_programs(tmp_path):
    h, _ = handler(tmp_path, SystemClock(), f'{{name: bad, type: exec, phases: [scheduled], '
                                            f'command: ["{PY}", "-c", "import sys; print(\'oops\'); sys.exit(3)"]}}')
    result = h.run(context(SystemClock()))
    assert (result.outcome, result.exit_code) == (FAILED, 3) and "oops" in result.output
    h, _ = handler(tmp_path, SystemClock(), '{name: gone, type: exec, phases: [scheduled], command: [/no/such/hook]}')
    result = h.run(context(SystemClock()))
    assert result.outcome == FAILED and "/no/such/hook" in result.detail


def test_a_hook_that_never_reads_stdin_does_not_block(tmp_path):
    h, _ = handler(tmp_path, SystemClock(), '{name: quiet, type: exec, phases: [scheduled], command: [/bin/true]}')
    assert h.run(context(SystemClock(), description="x" * 1_000_000)).outcome == OK


@pytest.mark.parametrize("item, key", [
    ("{name: h, type: exec, phases: [scheduled]}", "handlers[0]"),
    ("{name: h, type: exec, phases: [scheduled], command: []}", "handlers[0].command"),
    ("{name: h, type: exec, phases: [scheduled], command: /bin/true}", "handlers[0].command"),
    ("{name: h, type: exec, phases: [scheduled], command: [/bin/true], cwd: relative}", "handlers[0].cwd"),
    ("{name: h, type: webhook, phases: [scheduled]}", "handlers[0].url"),
    ("{name: h, type: webhook, phases: [scheduled], url: 'http://x', template: '{event_id.__class__}'}",
     "handlers[0].template"),
    ("{name: h, type: webhook, phases: [scheduled], url: 'http://x', preset: discord}", "handlers[0].preset"),
    ("{name: h, type: health, phases: [scheduled], started_state: Critical}", "handlers[0].started_state"),
])
def test_bad_handler_options_are_refused_naming_the_key(item, key):
    with pytest.raises(ConfigError) as err:
        loads(f"handlers:\n  - {item}\n", "maintd.yaml")
    assert err.value.key == key and err.value.line == 2


# --- webhook -------------------------------------------------------------------------------------

HOOK_URL = "https://hooks.example.invalid/services/T000/B000/s3cr3t"


class Frozen:
    def now(self):
        return NOW

    def monotonic(self):
        return 0.0

    def wait(self, event, seconds):
        return event.is_set()


@responses.activate
def test_slack_and_teams_presets_post_one_readable_line(tmp_path):
    responses.post(HOOK_URL, status=200)
    for preset in ("slack", "teams"):
        h, services = handler(tmp_path, Frozen(), f'{{name: ops, type: webhook, phases: [scheduled], '
                                                 f'url: "{HOOK_URL}", preset: {preset}}}')
        services.store.record("A1B2C3D4-0000-4000-8000-000000000001", "approval", {"status": "sent", "by": "vm-1"})
        assert h.run(context(Frozen(), description="")).outcome == OK
    slack, teams = (json.loads(c.request.body) for c in responses.calls)
    line = "Reboot of vm-3 not before 14:05 UTC (in 9 min), approved by vm-1"
    assert slack == {"text": line}
    assert teams["text"] == line
    assert teams["attachments"][0]["content"]["body"][0]["text"] == line


@responses.activate
def test_generic_preset_posts_the_hook_payload_and_template_renders_fields(tmp_path):
    responses.post(HOOK_URL, status=204)
    h, _ = handler(tmp_path, Frozen(), f'{{name: ops, type: webhook, phases: [completed], url: "{HOOK_URL}"}}')
    assert h.run(context(Frozen(), phase="completed", outcome="canceled")).outcome == OK
    body = json.loads(responses.calls[0].request.body)
    assert body["phase"] == "completed" and body["outcome"] == "canceled" and body["event"]["EventType"] == "Reboot"
    h, _ = handler(tmp_path, Frozen(), f'{{name: t, type: webhook, phases: [scheduled], url: "{HOOK_URL}", '
                                       f'template: \'{{{{"id": "{{event_id}}", "msg": "{{text}}"}}}}\', '
                                       f'headers: {{X-Team: sre}}}}')
    assert h.run(context(Frozen(), description="")).outcome == OK
    call = responses.calls[1].request
    assert json.loads(call.body)["id"] == "A1B2C3D4-0000-4000-8000-000000000001"
    assert call.headers["X-Team"] == "sre" and call.headers["Content-Type"] == "application/json"


@responses.activate
def test_webhook_retries_5xx_not_4xx_and_never_logs_the_url(tmp_path, logs):
    url_file = tmp_path / "url"
    url_file.write_text(HOOK_URL + "\n")
    responses.post(HOOK_URL, status=503)
    responses.post(HOOK_URL, status=503)
    responses.post(HOOK_URL, status=200)
    h, _ = handler(tmp_path, SystemClock(), f'{{name: ops, type: webhook, phases: [scheduled], url_file: "{url_file}", '
                                            f'preset: slack, retries: 3}}')
    ctx = context(SystemClock())
    ctx.clock = Frozen()
    result = h.run(ctx)
    assert result.outcome == OK and len(responses.calls) == 3 and "after 3 attempts" in result.detail
    responses.replace(responses.POST, HOOK_URL, status=400, body="invalid_payload")
    result = h.run(ctx)
    assert result.outcome == FAILED and len(responses.calls) == 4, "a 400 is not retried"
    assert "s3cr3t" not in result.detail and "s3cr3t" not in json.dumps(logs)
    url_file.unlink()
    assert "cannot be read" in h.run(ctx).detail


# --- health --------------------------------------------------------------------------------------

SF = "https://sf.example.invalid:19080"


@responses.activate
def test_health_reports_follow_the_phases_locally_and_in_service_fabric(tmp_path):
    responses.post(f"{SF}/Nodes/vm-3/$/ReportHealth", status=200)
    h, services = handler(tmp_path, Frozen(), f'{{name: report, type: health, phases: [scheduled, started, completed], '
                                              f'started_state: Error, cluster_url: "{SF}", ttl: 30m}}')
    prop = "maintenance/A1B2C3D4-0000-4000-8000-000000000001"

    def local():
        return {(e.report.source_id, e.report.property): e.report.state for e in services.health.snapshot()}

    assert h.run(context(Frozen())).outcome == OK
    assert local() == {("maintd", prop): HealthState.WARNING}
    assert h.run(context(Frozen(), phase="started")).outcome == OK
    assert local() == {("maintd", prop): HealthState.ERROR}
    assert h.run(context(Frozen(), phase="completed", outcome="completed")).outcome == OK
    assert local() == {}
    bodies = [json.loads(c.request.body) for c in responses.calls]
    assert [b["HealthState"] for b in bodies] == ["Warning", "Error", "Ok"]
    assert all(b["SourceId"] == "maintd" and b["Property"] == prop for b in bodies)
    assert bodies[0]["TimeToLiveInMilliSeconds"] == "1800000" and bodies[2]["RemoveWhenExpired"] is True
    seqs = [int(b["SequenceNumber"]) for b in bodies]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    assert "api-version=6.0" in responses.calls[0].request.url


@responses.activate
def test_a_failed_service_fabric_push_fails_the_run_but_keeps_the_local_report(tmp_path):
    responses.post(f"{SF}/Nodes/vm-3/$/ReportHealth", status=403, body="FABRIC_E_UNAUTHORIZED")
    h, services = handler(tmp_path, Frozen(), f'{{name: report, type: health, phases: [scheduled], '
                                              f'cluster_url: "{SF}"}}')
    result = h.run(context(Frozen()))
    assert result.outcome == FAILED and "403" in result.detail
    assert [e.report.state for e in services.health.snapshot()] == [HealthState.WARNING]
