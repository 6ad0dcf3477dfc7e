"""One owner for the coordination state: the loop ticks 50 events in and out while other threads
read the views (`/v1/status`, `/v1/events/{id}`, `/v1/fleet`) and peers push hints; no reader ever
meets a state being changed under it (before: "dictionary changed size during iteration", an
HTTP 500, because the approver and the loop changed the per-event dict the API iterated)."""

from __future__ import annotations

import re
import sys
import threading
from datetime import timedelta

import responses

from agent.clock import SystemClock
from agent.loop.tick import Tick
from agent.model.events import Event
from agent.model.tracker import Tracked
from agent.policy.approval_policy import Profile
from tests.coordination.test_coordinator import make_coordinator

AUTO = Profile(name="default", approval="auto")


def events(clock, first: int, count: int) -> dict[str, Tracked]:
    out = {}
    for i in range(first, first + count):
        e = Event(f"E{i}", "Reboot", "Scheduled", ("vm1", "vm2", "vm3"), not_before=clock.now() + timedelta(minutes=15))
        out[e.event_id] = Tracked(e, True, clock.now(), "b", False)
    return out


def test_views_and_hints_never_fail_while_50_events_come_and_go(tmp_path):
    """The loop's thread ticks 200 times over a window of 50 events that moves by 5 each tick; four
    threads read every view and push hints all the while. Not one call raises."""
    clock = SystemClock()
    errors: list[BaseException] = []
    done = threading.Event()
    window: list[dict[str, Tracked]] = [events(clock, 0, 50)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so readers land inside the loop's changes
    with responses.RequestsMock(assert_all_requests_are_fired=False) as peers:
        peers.add(responses.GET, re.compile(r"http://vm[23]\.peers\.invalid:8088/v1/events/E\d+"),
                  json={"ready": False, "names_self": True, "rank": 1})
        peers.add(responses.POST, re.compile(r"http://vm1\.peers\.invalid:8088/.*"), json={})
        coord, _, _ = make_coordinator(tmp_path, clock)

        def read() -> None:
            while not done.is_set():
                try:
                    tracked = window[-1]
                    coord.status(tracked, "vm1")
                    coord.fleet(tracked, "vm1", lambda t: False)
                    for eid in list(tracked)[:10]:
                        coord.view(eid)
                        coord.hint(eid, "vm2")
                except BaseException as exc:  # any failure of a reader is the finding
                    errors.append(exc)
                    return

        readers = [threading.Thread(target=read) for _ in range(4)]
        for r in readers:
            r.start()
        try:
            for i in range(200):
                window.append(events(clock, 5 * i, 50))
                coord.tick(Tick.of(window[-1], "vm1", AUTO, False, lambda t: [],
                                   now=clock.now(), monotonic=clock.monotonic()))
        finally:
            done.set()
            for r in readers:
                r.join(10)
            coord.stop()
            sys.setswitchinterval(switch)
    assert errors == []

