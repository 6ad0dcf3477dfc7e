"""The silence on an ordinary bad day, end to end: the emulator, a real `maintd run` and a real Alertmanager
(Debian's prometheus-alertmanager) on 127.0.0.1, measured from outside.

- An Alertmanager that refuses, hangs or trickles costs the drain nothing: the VM leaves rotation (/probe 503)
  and the StartRequests POST comes no sooner than the load balancer wait after it, with a Reboot 45 s away.
- The drain listed before the silence (a natural order): while the VM is out of rotation a silence is active,
  from the first sample on (/probe and the Alertmanager's silences sampled side by side).
"""

from __future__ import annotations

import pytest

from tests.alertmanager import Trickle, alertmanagers, needs_alertmanager, sampling  # noqa: F401 (fixture)
from tests.e2e.harness import wait_until

pytestmark = [pytest.mark.e2e, needs_alertmanager]
LB_WAIT = 11.0
"""probe.lb_timeout 11s (its minimum) and drain_grace 0s: the drain's wait."""
PROBE = {"lb_timeout": "11s", "lb_interval": "5s", "drain_grace": "0s"}


def silence(urls: list[str]) -> dict[str, object]:
    return {"name": "silence", "type": "alertmanager", "phases": ["scheduled", "started", "completed"],
            "urls": urls, "matchers": ['instance=~"{vm}(:[0-9]+)?"'], "margin": "2m", "recheck": "1s"}


DRAIN = {"name": "drain", "type": "drain", "phases": ["scheduled", "completed"]}


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
        assert seen.out_at is not None and seen.window <= 1.0, f"left rotation, seen within {seen.window:.2f}s"
        gap = approval["monotonic"] - seen.out_at  # at least, and at most `window` less than, the time out
        assert gap >= LB_WAIT - seen.window, \
            f"out of rotation {gap:.2f}s (+ at most {seen.window:.2f}s) before the POST; the LB needs {LB_WAIT:g}s"
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
