"""A scrape never misses a series: labelled gauges are swapped whole (new values set, then the series
gone removed), never cleared and refilled, so a scrape taken between any two gauge calls of a tick
shows every series that exists both before and after that tick."""

from __future__ import annotations

import email.utils
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import Gauge

from agent.clock import FakeClock
from agent.config.config import loads
from agent.loop.daemon import Daemon
from agent.systemd import Notifier
from tests.loop.test_daemon import SE, imds  # noqa: F401 (IMDS scripted for the daemon's life; approvals succeed)

UTC = UTC
START = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)


def event(eid: str, etype: str, minutes: int, resources: tuple[str, ...] = ("vm1",)) -> dict[str, Any]:
    return {"EventId": eid, "EventType": etype, "ResourceType": "VirtualMachine", "Resources": list(resources),
            "EventStatus": "Scheduled", "EventSource": "Platform", "DurationInSeconds": -1, "Description": "",
            "NotBefore": email.utils.format_datetime(START + timedelta(minutes=minutes), usegmt=True)}


def series(d: Any) -> set[str]:
    """Every series a scrape shows (name and labels, without the value)."""
    return {line.rsplit(" ", 1)[0] for line in d.metrics.render().decode().splitlines() if not line.startswith("#")}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


def test_scrapes_between_every_gauge_call_of_a_tick_miss_no_lasting_series(tmp_path, clock, imds, monkeypatch):
    """maintd_events, maintd_next_maintenance_timestamp_seconds and maintd_event_prepare_timestamp_seconds keep
    every series that lives through a tick in each scrape taken in the middle of it."""
    d = Daemon(loads(f"identity: {{name: vm1}}\nstate: {{dir: {tmp_path}}}\nimds: {{endpoint: '{imds.url}'}}\n"
                    "profiles:\n  - {name: default, approval: never}\nprepare: {lead_time: 10m}\n"),
              clock, boot_id="b", notifier=Notifier({}))
    d.start()
    scrapes: list[set[str]] = []
    for gauge in [g for g in vars(d.metrics).values() if isinstance(g, Gauge)]:
        for name in ("clear", "remove", "labels"):
            real = getattr(gauge, name)
            monkeypatch.setattr(gauge, name,
                                lambda *a, _real=real, **kw: (_real(*a, **kw), scrapes.append(series(d)))[0])
    documents = [[event("E1", "Reboot", 60), event("E2", "Freeze", 90, ("vm2",))],
                 [event("E1", "Reboot", 60), event("E2", "Freeze", 90, ("vm2",)), event("E3", "Redeploy", 120)],
                 [event("E1", "Reboot", 45), event("E3", "Redeploy", 120), event("E4", "Reboot", 30)],
                 [event("E3", "Redeploy", 120)]]
    try:
        for n, events in enumerate(documents, 1):
            imds.upsert("GET", SE, json={"DocumentIncarnation": n, "Events": events})
            before, scrapes[:] = series(d), []
            clock.advance(1)
            d.tick()
            lasting = before & series(d)
            assert n == 1 or any(s.startswith("maintd_event_prepare_timestamp_seconds{") for s in lasting)
            for scrape in scrapes:
                assert lasting <= scrape, sorted(lasting - scrape)
    finally:
        d.shutdown()
