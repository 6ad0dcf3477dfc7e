"""`maintd run` against `maintd emulate`, both real processes on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys

import pytest

from agent.state.journal import JOURNAL_FILE
from tests.e2e.harness import CLEAN_ENV, wait_until

pytestmark = pytest.mark.e2e


def scheduled_gets(emu, vm="vm-1"):
    return [r for r in emu.requests(vm) if r["method"] == "GET" and "scheduledevents" in r["path"]]


def test_polls_on_cadence_with_the_imds_headers_and_no_proxy(start_emulator, start_agent):
    """Every poll carries Metadata: true and the api-version; a proxy in the environment is ignored;
    the gaps between polls match imds.poll_interval (100 ms here)."""
    emu = start_emulator(["vm-1"])
    proxy = "http://127.0.0.1:9"
    agent = start_agent(emu, "vm-1", env={"HTTP_PROXY": proxy, "http_proxy": proxy, "NO_PROXY": ""})
    gets = wait_until(lambda: (g := scheduled_gets(emu)) and len(g) >= 30 and g, 20, "30 polls")
    for r in gets:
        headers = {k.lower(): v for k, v in r["headers"].items()}
        assert headers.get("metadata") == "true"
        assert "api-version=2020-07-01" in r["query"]
        assert r["status"] in (200, 304)
    times = [r["time"] for r in gets[5:30]]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert 0.08 <= statistics.median(gaps) <= 0.2, gaps
    assert agent.get("/v1/status").json()["imds"]["consecutive_failures"] == 0


def test_reboot_for_this_vm_is_tracked_approved_and_completed(start_emulator, start_agent):
    """appeared → approval → Started → gone: each transition logged, persisted and journaled."""
    # Started for 3 s: a poll stalled for longer than that on a loaded host would miss the Started state
    emu = start_emulator(["vm-1", "vm-2"], "--started-duration", "3")
    agent = start_agent(emu, "vm-1")
    eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=120)
    appeared = agent.wait_log("event.appeared", event_id=eid)
    assert appeared["names_self"] is True and appeared["event_type"] == "Reboot"
    agent.wait_log("approval.sent", event_id=eid)
    agent.wait_log("event.status_changed", event_id=eid, status="Started")
    agent.wait_log("event.completed", event_id=eid)
    assert len(emu.approvals("vm-1")) == 1

    state = agent.state()
    assert eid in json.dumps(state)
    history = subprocess.run([sys.executable, "-m", "agent", "events", "--history", "--json",
                              "--config", str(agent.config_path)], capture_output=True, text=True, env=CLEAN_ENV)
    kinds = [json.loads(line)["kind"] for line in history.stdout.splitlines() if eid in line]
    assert kinds[0] == "event.appeared" and "approval.sent" in kinds and kinds[-1] == "event.completed", kinds


def test_an_event_for_another_vm_is_tracked_but_not_acted_on(start_emulator, start_agent):
    emu = start_emulator(["vm-1", "vm-10"])
    agent = start_agent(emu, "vm-1")
    eid = emu.add_event(event_type="Reboot", resources=["vm-10"], notice=120)
    seen = wait_until(lambda: [e for e in agent.get("/v1/events").json() if e["EventId"] == eid], 10,
                      "the other VM's event in /v1/events", )
    assert seen[0]["names_self"] is False, "vm-1 is not vm-10: never a substring match"
    assert not agent.events("approval.sent")


def test_imds_outage_is_survived_and_reported(start_emulator, start_agent):
    """503s back off, show in /v1/health, keep /healthz 200 and the probe in rotation, then recover."""
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {"imds": {"warn_after_failures": 2}})
    emu.admin("POST", "faults", kind="status", status=503)
    agent.wait_log("poll.failed")
    wait_until(lambda: agent.get("/v1/health").json()["AggregatedHealthState"] != "Ok", 10, "health to show it")
    assert agent.get("/healthz").status_code == 200
    assert agent.get("/probe").status_code == 200, "an IMDS outage must never drain the fleet"
    emu.admin("DELETE", "faults")
    agent.wait_log("poll.recovered")


def test_sighup_with_a_bad_config_keeps_the_old_one_and_sigterm_exits_0(start_emulator, start_agent):
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1")
    good = agent.config_path.read_text()
    agent.config_path.write_text(good + "\nimds:\n  poll_intervall: 1s\n")
    agent.proc.send_signal(signal.SIGHUP)
    failed = agent.wait_log("config.reload_failed")
    assert "poll_intervall" in failed["error"] or "imds" in failed["error"]
    assert agent.get("/healthz").status_code == 200
    agent.config_path.write_text(good)
    agent.proc.send_signal(signal.SIGHUP)
    agent.wait_log("config.reloaded")
    assert agent.stop() == 0
    assert agent.events("daemon.stopped")


def drained_by(agent) -> list[str]:
    """Who drained, in order, as the audit journal names them."""
    journal = [json.loads(line) for line in (agent.workdir / "state" / JOURNAL_FILE).read_text().splitlines()]
    return [e["by"] for e in journal if e["kind"] == "rotation.drained"]


def test_the_cli_talks_to_the_running_daemon(start_emulator, start_agent):
    """Root's `maintd` commands reach the daemon over its unix socket (the journal names uid 0); `--url` with
    $MAINTD_TOKEN still works over TCP."""
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1")

    def maintd(*args, env=CLEAN_ENV):
        return subprocess.run([sys.executable, "-m", "agent", *args, "--config", str(agent.config_path)],
                              capture_output=True, text=True, env=env, timeout=30)

    status = maintd("status")
    assert status.returncode == 0 and "maintd " in status.stdout and " on vm-1" in status.stdout
    drained = maintd("drain", "--reason", "kernel update")
    assert drained.returncode == 0 and "kernel update" in drained.stdout
    assert agent.get("/probe").status_code == 503
    assert drained_by(agent) == ["uid 0 (unix socket)"]
    assert maintd("undrain").returncode == 0
    assert agent.get("/probe").status_code == 200
    eid = emu.add_event(event_type="Freeze", resources=["vm-1"], notice=600, duration_seconds=5)
    wait_until(lambda: eid in maintd("events").stdout, 10, "the event in `maintd events`")
    assert maintd("health").returncode == 0
    missing = maintd("approve", "NO-SUCH-EVENT")
    assert missing.returncode == 1 and "404" in missing.stderr
    by_url = maintd("drain", "--reason", "script", "--url", agent.base, env={**CLEAN_ENV, "MAINTD_TOKEN": agent.token})
    assert by_url.returncode == 0, by_url.stderr
    assert drained_by(agent)[-1] == "127.0.0.1 (token)"


def test_the_secure_default_refuses_a_tokenless_loopback_drain_and_says_how(start_emulator, start_agent):
    """The shipped server settings: a loopback POST without the token is 401 naming the unix socket, the token and
    the opt-out; reads from loopback stay open; the token works; root over the socket works."""
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1")
    refused = agent.post("/v1/drain", {"reason": "nobody"}, token=False)
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
    for how in (agent.unix_socket, "sudo maintd drain", "server.token_file", "require_token_on_loopback: false"):
        assert how in refused.json()["error"]
    assert agent.get("/probe").status_code == 200 and agent.get("/v1/status").status_code == 200
    assert agent.post("/v1/drain", {"reason": "script"}).status_code == 200
    assert agent.post("/v1/undrain").status_code == 200
    done = subprocess.run([sys.executable, "-m", "agent", "drain", "--reason", "root", "--config",
                           str(agent.config_path)], capture_output=True, text=True, env=CLEAN_ENV, timeout=30)
    assert done.returncode == 0, done.stderr
    assert drained_by(agent) == ["127.0.0.1 (token)", "uid 0 (unix socket)"]


def test_opting_out_lets_loopback_act_without_the_token(start_emulator, start_agent):
    """server.require_token_on_loopback: false (the explicit opt-out) restores the old loopback rule."""
    emu = start_emulator(["vm-1"])
    agent = start_agent(emu, "vm-1", {"server": {"require_token_on_loopback": False}})
    assert agent.post("/v1/drain", {"reason": "local"}, token=False).status_code == 200
    assert drained_by(agent) == ["127.0.0.1"]
