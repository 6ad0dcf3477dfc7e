"""The loop in-process, with a fake clock and a scripted IMDS on 127.0.0.1: cadence, backoff, outages."""

from __future__ import annotations

import errno
import os

import pytest

from agent.config.config import loads
from agent.health.health_store import HealthState
from agent.loop.daemon import Daemon
from agent.systemd import Notifier
from tests.imds_server import FakeImds, Raw, wait_for
from tests.samples import sample

SE = "/metadata/scheduledevents"
NB = "Mon, 19 Sep 2026 18:29:47 GMT"


def doc(*events, incarnation=1):
    return {"DocumentIncarnation": incarnation, "Events": list(events)}


def reboot(eid="E1", resources=("vm1",), status="Scheduled"):
    return {"EventId": eid, "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": list(resources),
            "EventStatus": status, "NotBefore": NB if status == "Scheduled" else "", "Description": "",
            "EventSource": "Platform", "DurationInSeconds": -1}


@pytest.fixture
def imds():
    """IMDS scripted for the daemon's whole life (its worker threads too); approvals succeed."""
    server = FakeImds()
    server.post(SE, status=200)
    yield server
    server.close()


@pytest.fixture
def daemon(tmp_path, clock, imds):
    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\n"
                f"imds: {{endpoint: '{imds.url}', max_backoff: 10s, stale_after: 60s}}\n")
    d = Daemon(cfg, clock, boot_id="boot-1", notifier=Notifier({}))
    d.start()
    yield d
    d.shutdown()


def run_for(d, clock, seconds):
    end = clock.monotonic() + seconds
    while clock.monotonic() < end:
        d.tick()
        d.store.wait_saved(5)  # the loop hands state writes to a background writer: let it land
        d._sleep_until_due()


def poll_times(calls_at):
    return [b - a for a, b in zip(calls_at, calls_at[1:], strict=False)]


def test_polls_stay_on_their_deadlines_even_when_imds_is_slow(daemon, clock, imds):
    """600 polls take 600 s ± one interval although each answer takes 300 ms of (fake) time."""
    def slow(request):
        clock.advance(0.3)
        return 200, {"Content-Type": "application/json"}, '{"DocumentIncarnation": 1, "Events": []}'

    imds.add_callback("GET", SE, slow)
    start = clock.monotonic()
    while daemon.cadence.polls < 600:
        daemon.tick()
        daemon._sleep_until_due()
    assert abs((clock.monotonic() - start) - 600) <= 1.0


def test_failures_back_off_up_to_max_backoff_then_the_cadence_returns(daemon, clock, imds):
    times: list[float] = []

    def failing(request):
        times.append(clock.monotonic())
        return 503, {}, "Service Unavailable"

    imds.add_callback("GET", SE, failing)
    run_for(daemon, clock, 120)
    gaps = poll_times(times)
    assert gaps[0] >= 1.0 and max(gaps) <= 10.0 + 1e-6, "exponential, capped at imds.max_backoff"
    assert len(times) < 25, "120 s of outage cost well under 120 requests"
    imds.replace("GET", SE, json=doc())
    daemon.cadence.next_poll = clock.monotonic()
    before = len(imds.calls)
    run_for(daemon, clock, 10)
    assert len(imds.calls) - before in (10, 11), "back to one poll per second after the first success"


def test_retry_after_is_honoured(daemon, clock, imds):
    times: list[float] = []

    def limited(request):
        times.append(clock.monotonic())
        return 429, {"Retry-After": "7"}, "Too many requests"

    imds.add_callback("GET", SE, limited)
    run_for(daemon, clock, 20)
    assert all(g >= 7 for g in poll_times(times))


def test_a_400_is_reported_as_error_with_the_body_and_not_hammered(daemon, clock, imds, logs):
    body = '{"error": "Bad request. api-version is invalid or was not specified in the request."}'
    imds.get(SE, status=400, body=body)
    run_for(daemon, clock, 60)
    failed = [e for e in logs if e["event"] == "poll.failed"]
    assert len(failed) == 1 and "api-version" in failed[0]["body"], "logged once, with IMDS's body"
    assert len(imds.calls) < 15
    reports = {(r.report.source_id, r.report.property): r.report.state for r in daemon.health.snapshot()}
    assert reports[("imds", "request")] == HealthState.ERROR


def test_imds_gone_for_an_hour_is_survived_and_no_event_is_lost(daemon, clock, imds, logs):
    imds.get(SE, body=ConnectionError("no route to host"))
    run_for(daemon, clock, 3600)
    assert daemon.view.stuck_for(clock.monotonic()) == 0, "/healthz stays 200: the loop kept ticking"
    poll = next(r for r in daemon.health.snapshot() if r.report.property == "poll")
    assert poll.report.state == HealthState.ERROR and "no successful poll" in poll.report.description
    assert daemon.rotation.verdict().in_rotation, "an IMDS outage never takes the VM out of rotation"
    assert len(imds.calls) <= 3600 / 7, "backed off during the outage"
    imds.replace("GET", SE, json=doc(reboot()))
    run_for(daemon, clock, 15)
    assert any(e["event"] == "event.appeared" and e["event_id"] == "E1" for e in logs)
    assert any(e["event"] == "poll.recovered" for e in logs)
    assert next(r for r in daemon.health.snapshot() if r.report.property == "poll").report.state == HealthState.OK


def test_a_malformed_document_is_counted_and_the_loop_goes_on(daemon, clock, imds, logs):
    imds.get(SE, body="{not json", content_type="application/json")
    run_for(daemon, clock, 5)
    assert any(e["event"] == "poll.failed" for e in logs)
    imds.replace("GET", SE, json=doc(reboot(), {"EventId": 5}))
    daemon.cadence.next_poll = clock.monotonic()
    run_for(daemon, clock, 3)
    assert sample(daemon.metrics, "maintd_events_malformed_total") >= 1
    assert "E1" in daemon.tracked


def test_finished_events_leave_memory_and_the_state_file_after_the_retention(tmp_path, clock, imds):
    """state.retention is kept: a finished event stays for `retention` (history, `maintd events --history`),
    then leaves memory and state.json within a quarter of the retention; a present event is never dropped."""
    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}, retention: 2m}}\n"
                f"imds: {{endpoint: '{imds.url}'}}\n")
    d = Daemon(cfg, clock, boot_id="boot-1", notifier=Notifier({}))
    d.start()
    try:
        imds.get(SE, json=doc(reboot("gone"), reboot("stays")), headers={"Content-Type": "application/json"})
        run_for(d, clock, 2)
        imds.replace("GET", SE, json=doc(reboot("stays"), incarnation=2),
                     headers={"Content-Type": "application/json"})
        run_for(d, clock, 110)
        assert "gone" in (tmp_path / "state.json").read_text(), "kept while within the retention"
        run_for(d, clock, 2 * 60 / 4 + 15)
        state = (tmp_path / "state.json").read_text()
        assert "gone" not in state and "stays" in state
        assert d.store.result("gone", "approval") is None
    finally:
        d.shutdown()


def test_a_prune_on_a_full_disk_is_reported_and_written_once_space_returns(tmp_path, clock, imds, monkeypatch):
    """Pruning while the disk is full: the loop goes on, the failed write is counted and shown as
    state/write Error, and the pruned state reaches state.json once space returns."""
    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}, retention: 1m}}\n"
                f"imds: {{endpoint: '{imds.url}'}}\n")
    d = Daemon(cfg, clock, boot_id="boot-1", notifier=Notifier({}))
    d.start()
    try:
        imds.get(SE, json=doc(reboot("gone")), headers={"Content-Type": "application/json"})
        run_for(d, clock, 2)
        imds.replace("GET", SE, json=doc(incarnation=2), headers={"Content-Type": "application/json"})
        run_for(d, clock, 2)
        real_replace = os.replace

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "replace", full)
        run_for(d, clock, 60 + 60 / 4 + 2)
        assert d.store.result("gone", "approval") is None and d.cadence.polls > 70, "pruned in memory; the loop went on"
        assert sample(d.metrics, "maintd_state_write_failures_total") >= 1
        assert any(e.report.property == "write" and e.state == HealthState.ERROR for e in d.health.snapshot())
        assert "gone" in (tmp_path / "state.json").read_text(), "the disk refused the pruned state"
        monkeypatch.setattr(os, "replace", real_replace)
        run_for(d, clock, 2)
        assert "gone" not in (tmp_path / "state.json").read_text()
    finally:
        d.shutdown()


def test_the_watchdog_is_pinged_while_imds_takes_its_time_with_the_first_answer(tmp_path, imds):
    """IMDS may take minutes to answer the first call: systemd must keep hearing from maintd meanwhile
    (WatchdogSec would otherwise kill it), while steady polls run on the loop's own thread."""
    import socket
    import time

    from agent.clock import SystemClock

    address = str(tmp_path / "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(address)
    listener.settimeout(0.01)

    def slow(call):
        time.sleep(0.6)
        return 200, {"Content-Type": "application/json"}, '{"DocumentIncarnation": 1, "Events": []}'

    imds.add_callback("GET", SE, slow)
    cfg = loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\nimds: {{endpoint: '{imds.url}'}}\n")
    d = Daemon(cfg, SystemClock(), boot_id="b",
               notifier=Notifier({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "200000"}))
    d.start()
    try:
        d.tick()
        assert d.cadence.polls == 1
        pings = 0
        while True:
            try:
                pings += listener.recv(4096).count(b"WATCHDOG=1")
            except TimeoutError:
                break
        assert pings >= 4, "pinged about every 0.1 s during the 0.6 s answer"
    finally:
        d.shutdown()
        listener.close()


BUSY_SUPERSCRIPT = Raw(b"HTTP/1.1 503 Busy\r\nRetry-After: \xb2\r\nContent-Length: 0\r\n\r\n", then="keep")


def test_a_retry_after_in_unicode_digits_is_one_failed_poll_and_the_loop_goes_on(daemon, clock, imds):
    """Issue 24: `Retry-After: ²` on a poll is a failed poll (no Retry-After), not an exception out of the
    loop; the next answer's event is tracked."""
    imds.add_callback("GET", SE, lambda _: BUSY_SUPERSCRIPT)
    imds.get(SE, json=doc(reboot()))
    run_for(daemon, clock, 5)
    assert "E1" in daemon.tracked and daemon.cadence.polls >= 1


def test_start_survives_a_retry_after_in_unicode_digits_on_the_compute_call(tmp_path, clock, imds):
    """Issue 24: the same answer to the compute call at start is retried like any failed call, and the
    VM's name comes from the next one."""
    imds.add_callback("GET", "/metadata/instance/compute", lambda _: BUSY_SUPERSCRIPT)
    imds.get("/metadata/instance/compute", json={"name": "vm1"})
    cfg = loads(f"state: {{dir: {tmp_path}}}\nimds: {{endpoint: '{imds.url}'}}\n")
    d = Daemon(cfg, clock, boot_id="boot-1", notifier=Notifier({}))
    try:
        d.start()
        wait_for(lambda: run_for(d, clock, 1) or d.vm_name == "vm1")  # the lookup runs off the loop
    finally:
        d.shutdown()
