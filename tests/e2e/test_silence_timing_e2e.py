"""The silence on an ordinary bad day, end to end: the emulator, a real `maintd run` and a real Alertmanager
(Debian's prometheus-alertmanager) on 127.0.0.1, measured from outside.

- An Alertmanager that refuses, hangs or trickles costs the drain nothing: the VM leaves rotation (/probe 503)
  and the StartRequests POST comes no sooner than the load balancer wait after it, with a Reboot 45 s away.
- The drain listed before the silence (a natural order): while the VM is out of rotation a silence is active,
  from the first sample on (/probe and the Alertmanager's silences sampled side by side).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from tests.alertmanager import Alertmanager, Trickle, alertmanagers, needs_alertmanager  # noqa: F401 (fixture)
from tests.e2e.harness import Agent, wait_until

pytestmark = [pytest.mark.e2e, needs_alertmanager]
LB_WAIT = 11.0
"""probe.lb_timeout 11s (its minimum) and drain_grace 0s: the drain's wait."""
SAMPLE_SLACK = 0.25
"""What sampling /probe from outside may lose of the measured time out of rotation (its period and one answer)."""
PROBE = {"lb_timeout": "11s", "lb_interval": "5s", "drain_grace": "0s"}


def silence(urls: list[str]) -> dict[str, object]:
    return {"name": "silence", "type": "alertmanager", "phases": ["scheduled", "started", "completed"],
            "urls": urls, "matchers": ['instance=~"{vm}(:[0-9]+)?"'], "margin": "2m", "recheck": "1s"}


DRAIN = {"name": "drain", "type": "drain", "phases": ["scheduled", "completed"]}


@dataclass
class Samples:
    """When the VM was first seen out of rotation, and what the Alertmanager said while it was out."""

    out_at: float | None = None
    out: int = 0
    unsilenced: list[float] = field(default_factory=list)
    errors: int = 0


@contextmanager
def sampling(agent: Agent, am: Alertmanager | None = None) -> Iterator[Samples]:
    """Sample /probe (and, with `am`, its active silences between two probes that both say out) until the end."""
    found, stop = Samples(), threading.Event()

    def out() -> bool:
        return agent.get("/probe").status_code == 503

    def run() -> None:
        while not stop.is_set():
            try:
                if out():
                    now = time.monotonic()
                    found.out_at = found.out_at if found.out_at is not None else now
                    if am is not None:
                        active = [s for s in am.live() if s["status"]["state"] == "active"]
                        if out():  # out before and after the read: the silence must have been active throughout
                            found.out += 1
                            if not active:
                                found.unsilenced.append(now - (found.out_at or now))
            except Exception:  # a sample that failed to answer is counted, never a dead sampler
                found.errors += 1
            stop.wait(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.parametrize("failure", ["refuses", "hangs", "trickles"])
def test_an_alertmanager_that_fails_costs_the_drain_nothing(start_emulator, start_agent, alertmanagers, failure):
    (am,) = alertmanagers(1)
    url, trickle = am.url, None
    if failure == "refuses":
        am.stop()
    elif failure == "hangs":
        am.pause()
    else:
        trickle = Trickle(am)
        url = trickle.url
    try:
        emu = start_emulator(["vm-1"], "--started-duration", "2")
        agent = start_agent(emu, "vm-1", {"probe": PROBE, "handlers": [silence([url]), DRAIN]})
        with sampling(agent) as seen:
            eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=45)
            (approval,) = wait_until(emu.approvals, 45, "the StartRequests POST")
        assert seen.out_at is not None, "the VM was never seen out of rotation"
        gap = approval["monotonic"] - seen.out_at
        assert gap >= LB_WAIT - SAMPLE_SLACK, f"out of rotation {gap:.1f}s before the POST; the LB needs {LB_WAIT:g}s"
        agent.wait_log("handler.background", event_id=eid, handler="silence")
        drained = agent.wait_log("handler.finished", event_id=eid, handler="drain", phase="scheduled")
        assert drained["outcome"] == "ok" and "shortened" not in drained["detail"], drained["detail"]
        if failure == "hangs":  # it answers again while the silence still tries in the background: it is made
            am.resume()
            wait_until(lambda: am.live(), 30, "the silence, made by the retries in the background")
    finally:
        if failure == "hangs":
            am.resume()
        if trickle is not None:
            trickle.close()


@pytest.mark.parametrize("hanging_first", [False, True], ids=["one replica", "a hanging replica listed first"])
def test_with_the_drain_listed_first_a_silence_is_active_while_the_vm_is_out_of_rotation(
        start_emulator, start_agent, alertmanagers, hanging_first):
    replicas = alertmanagers(2 if hanging_first else 1)
    am = replicas[-1]  # the one that answers, sampled
    if hanging_first:
        replicas[0].pause()
    try:
        emu = start_emulator(["vm-1"], "--started-duration", "2")
        agent = start_agent(emu, "vm-1", {"probe": PROBE, "handlers": [DRAIN, silence([r.url for r in replicas])]})
        with sampling(agent, am) as seen:
            eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=300)
            wait_until(emu.approvals, 60, "the StartRequests POST")
            agent.wait_log("event.completed", event_id=eid, timeout=60)
            wait_until(lambda: agent.get("/probe").status_code == 200, 20, "the VM back in rotation")
        assert seen.out >= 50, f"only {seen.out} samples out of rotation: the check would say nothing"
        gaps = seen.unsilenced
        assert gaps == [], (f"{len(gaps)} of {seen.out} samples out of rotation had no active silence, from "
                            f"{min(gaps, default=0):.2f}s to {max(gaps, default=0):.2f}s after the VM left")
        assert seen.errors <= seen.out // 10, f"{seen.errors} samples failed"
        wait_until(lambda: am.live() == [], 20, "the silence expired once the VM is back")
    finally:
        if hanging_first:
            replicas[0].resume()
