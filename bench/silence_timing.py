"""Silence timing on a bad day (issue 35): the emulator, a real `maintd run` and a real Alertmanager.

For each way an Alertmanager fails (answers, refuses: stopped; hangs: SIGSTOP; trickles: a proxy sending
its answer a byte every 0.3 s) and each notice (Reboot 45 s, Preempt 30 s, Reboot 300 s), with the
silence listed before the drain: how long after the event appeared the VM left rotation (/probe 503) and
how long it was out of rotation before the StartRequests POST (target: at least the drain's LB wait,
11 s, less the sampler's window: the VM left between the last 200 sent and the first 503 received).
With the drain listed first (one replica, and an HA pair whose first replica hangs): how many samples
saw the VM out of rotation with no active silence on the replica that answers (target: none).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import write
from tests.alertmanager import BINARY, Alertmanager, Trickle, sampling
from tests.e2e.harness import Agent, Emulator, wait_until

LB_WAIT = 11.0
PROBE = {"lb_timeout": "11s", "lb_interval": "5s", "drain_grace": "0s"}
DRAIN = {"name": "drain", "type": "drain", "phases": ["scheduled", "completed"]}
NOTICES = (("Reboot", 45), ("Preempt", 30), ("Reboot", 300))


def silence(urls: list[str]) -> dict[str, Any]:
    return {"name": "silence", "type": "alertmanager", "phases": ["scheduled", "started", "completed"],
            "urls": urls, "matchers": ['instance=~"{vm}(:[0-9]+)?"'], "margin": "2m", "recheck": "1s"}


def failing(workdir: Path, failure: str) -> tuple[Alertmanager, str, Trickle | None]:
    am = Alertmanager(workdir)
    if failure == "refuses":
        am.stop()
    elif failure == "hangs":
        am.pause()
    elif failure == "trickles":
        trickle = Trickle(am)
        return am, trickle.url, trickle
    return am, am.url, None


def drain_time(workdir: Path, failure: str, event_type: str, notice: int) -> dict[str, float]:
    """Seconds from the event to the VM out of rotation, and out of rotation before the POST."""
    am, url, trickle = failing(workdir / "am", failure)
    emu = Emulator(["vm-1"], "--started-duration", "2")
    agent = None
    try:
        agent = Agent(workdir / "vm-1", emu.urls["vm-1"], "vm-1",
                      {"probe": PROBE, "handlers": [silence([url]), DRAIN]})
        with sampling(agent) as seen:
            added = time.monotonic()
            emu.add_event(event_type=event_type, resources=["vm-1"], notice=notice)
            (approval,) = wait_until(emu.approvals, notice + 30, "the StartRequests POST")
        out_at = seen.out_at if seen.out_at is not None else float("nan")
        return {"seen_to_out_s": round(out_at - added, 2), "out_to_post_s": round(approval["monotonic"] - out_at, 2),
                "sampler_window_s": round(seen.window, 3)}
    finally:
        if agent is not None:
            agent.stop()
        emu.stop()
        if trickle is not None:
            trickle.close()
        am.stop()  # a paused one is continued first


def unsilenced(workdir: Path, hanging_first: bool) -> dict[str, int]:
    """With the drain listed first: samples out of rotation, and those with no active silence."""
    replicas = [Alertmanager(workdir / f"am-{i}") for i in range(2 if hanging_first else 1)]
    if hanging_first:
        replicas[0].pause()
    emu = Emulator(["vm-1"], "--started-duration", "2")
    agent = None
    try:
        agent = Agent(workdir / "vm-1", emu.urls["vm-1"], "vm-1",
                      {"probe": PROBE, "handlers": [DRAIN, silence([r.url for r in replicas])]})
        with sampling(agent, replicas[-1]) as seen:
            eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=300)
            wait_until(emu.approvals, 60, "the StartRequests POST")
            agent.wait_log("event.completed", event_id=eid, timeout=60)
            wait_until(lambda: agent.get("/probe").status_code == 200, 20, "the VM back in rotation")
        return {"out_samples": seen.out, "unsilenced_samples": len(seen.unsilenced)}
    finally:
        if agent is not None:
            agent.stop()
        emu.stop()
        for r in replicas:
            r.stop()


def run(quick: bool = False) -> dict[str, Any]:
    if BINARY is None:
        print("  skipped: prometheus-alertmanager is not installed")
        return {}
    figures: dict[str, Any] = {"drain_time": {}, "drain_listed_first": {}}
    checks: list[tuple[str, str, str, bool]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for failure in ("answers", "refuses", "hangs", "trickles"):
            for event_type, notice in NOTICES[:1] if quick else NOTICES:
                case = f"{failure}, {event_type} {notice}s"
                got = drain_time(Path(tmp) / case.replace(" ", "_").replace(",", ""), failure, event_type, notice)
                figures["drain_time"][case] = got
                print(f"  {case}: out {got['seen_to_out_s']:.1f}s after the event, {got['out_to_post_s']:.1f}s "
                      "before the POST", flush=True)
                least = LB_WAIT - got["sampler_window_s"]
                checks.append((f"out of rotation before the POST ({case})", f"{got['out_to_post_s']:.2f} s",
                               f">= {least:.2f} s (11 s less the sampler's window)", got["out_to_post_s"] >= least))
        for hanging_first in (False, True):
            case = "HA pair, first replica hanging" if hanging_first else "one replica"
            got = unsilenced(Path(tmp) / f"first-{int(hanging_first)}", hanging_first)
            figures["drain_listed_first"][case] = got
            print(f"  drain listed first, {case}: {got['unsilenced_samples']} of {got['out_samples']} samples "
                  "out of rotation without an active silence", flush=True)
            checks.append((f"out of rotation without a silence, drain listed first ({case})",
                           f"{got['unsilenced_samples']} of {got['out_samples']} samples", "0",
                           got["unsilenced_samples"] == 0 and got["out_samples"] > 0))
    return write("silence_timing", figures, checks, quick)
