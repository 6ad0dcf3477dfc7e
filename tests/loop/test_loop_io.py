"""The loop's own thread never touches the disk: a whole event (appear → held → prepare → approve →
complete) ticked on a fake clock with every file call on the main thread recorded."""

from __future__ import annotations

import builtins
import email.utils
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agent.clock import FakeClock
from agent.config.config import loads
from agent.loop.daemon import Daemon
from agent.state.journal import read_journal
from agent.systemd import Notifier
from tests.imds_server import wait_for
from tests.loop.test_daemon import SE, imds  # noqa: F401 (IMDS scripted for the daemon's life; approvals succeed)

UTC = UTC
START = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
NOT_BEFORE = START + timedelta(minutes=30)
FILE_CALLS = ((os, "fsync"), (os, "open"), (os, "replace"), (os, "rename"), (builtins, "open"))


def reboot(status: str) -> dict[str, Any]:
    return {"EventId": "E1", "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm1"],
            "EventStatus": status, "EventSource": "Platform", "DurationInSeconds": -1, "Description": "",
            "NotBefore": email.utils.format_datetime(NOT_BEFORE, usegmt=True) if status == "Scheduled" else ""}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
def on_main(monkeypatch) -> list[str]:
    """Every file call made on the main thread once `spy` is switched on (the list it returns)."""
    seen: list[str] = []

    def spying(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                seen.append(f"{name}{args[:1]!r}")
            return real(*args, **kwargs)
        return call

    def spy() -> list[str]:
        for module, name in FILE_CALLS:
            monkeypatch.setattr(module, name, spying(f"{module.__name__}.{name}", getattr(module, name)))
        return seen

    return spy


def test_a_whole_event_is_handled_without_one_file_call_on_the_loop(tmp_path, clock, imds, on_main):
    """Appear, held for its lead time, prepared, approved, started, completed: no open, fsync or replace
    on the loop's thread, and everything still reaches the state file and the journal."""
    imds.upsert("GET", SE, json={"DocumentIncarnation": 1, "Events": [reboot("Scheduled")]})
    d = Daemon(loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\nimds: {{endpoint: '{imds.url}'}}\n"
                    "profiles:\n  - {name: slot, approval: auto, fixed_date: {start: 2026-01-05T10:20:00Z, "
                    "end: 2026-01-05T11:00:00Z}}\n  - {name: default, approval: never}\nprepare: {lead_time: 1m}\n"
                    "handlers:\n  - {name: checkpoint, type: exec, phases: [scheduled, completed], "
                    "command: [/bin/true]}\n"),
              clock, boot_id="boot-1", notifier=Notifier({}))
    d.start()
    seen = on_main()
    try:
        d.tick()  # appeared: held until a minute before the slot opens
        assert d.preparation.view("E1", {})["preparation"] == "held"
        clock.advance(19 * 60 + 30)
        d.tick()  # released: the preparation starts
        wait_for(lambda: d.readiness.is_ready(d.tracked["E1"]))
        clock.advance(40)
        d.tick()  # the slot is open and this VM is ready: the approval goes out
        d.coordinator.wait_idle(5)
        imds.upsert("GET", SE, json={"DocumentIncarnation": 2, "Events": [reboot("Started")]})
        clock.advance(1)
        d.tick()
        imds.upsert("GET", SE, json={"DocumentIncarnation": 3, "Events": []})
        clock.advance(1)
        d.tick()
        d.runner.wait_idle(5)
        assert d.store.wait_saved(5)
        during = list(seen)
    finally:
        d.shutdown()  # a stop may write on the main thread: the loop has ended by then
    assert during == [], during
    kinds = [e["kind"] for e in read_journal(tmp_path)]
    for kind in ("event.appeared", "plan.made", "preparation.started", "approval.sent", "event.completed"):
        assert kind in kinds, kinds
    assert d.store.result("E1", "preparation")["status"] == "started"


def test_the_loop_ticks_on_while_imds_takes_its_time_with_the_compute_metadata(tmp_path, clock, imds):
    """identity: auto and a compute call that hangs for 2 s: start and every tick return at once (the
    watchdog is pinged, signals are acted on); the name arrives as a result the loop takes."""
    release = threading.Event()
    began = time.monotonic()  # before the timer starts: `began` after the Daemon was built came up to 0.2 s short
    threading.Timer(2.0, release.set).start()

    def slow_compute(_: Any) -> tuple[int, dict[str, str], str]:
        release.wait(5)
        return 200, {"Content-Type": "application/json"}, '{"name": "vm1"}'

    imds.add_callback("GET", "/metadata/instance/compute", slow_compute)
    imds.upsert("GET", SE, json={"DocumentIncarnation": 1, "Events": [reboot("Scheduled")]})
    d = Daemon(loads(f"state: {{dir: {tmp_path}}}\nimds: {{endpoint: '{imds.url}'}}\n"), clock, boot_id="b",
              notifier=Notifier({}))
    try:
        d.start()
        longest = 0.0
        while not release.is_set():
            tick_began = time.monotonic()
            d.tick()
            longest = max(longest, time.monotonic() - tick_began)
            clock.advance(1)
            time.sleep(0.05)
        assert time.monotonic() - began >= 2.0 and longest < 0.5 and d.vm_name is None, longest
        wait_for(lambda: d.tick() is not None and clock.advance(1) is None and "E1" in d.tracked)
        assert d.vm_name == "vm1" and d.parts.services.settings.vm_name == "vm1"
    finally:
        d.shutdown()
