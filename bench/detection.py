"""Detection latency: event created in the emulator -> first handler started, and -> probe 503.

Agents poll at the real default (1 s), so the target is p99 <= poll interval + 50 ms. Each event
has a short notice, so the drain's wait is cut to its deadline; it then starts and ends by itself
and the probe returns to 200 before the next event, created at a random phase of the poll cycle.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import summary, write
from tests.e2e.harness import Agent, Emulator, http, wait_until

VMS = ("vm-1", "vm-2", "vm-3")
POLL = 1.0
PROBE_EVERY = 0.005
"""How often the bench asks the probe while it waits for the 503 (a fast load balancer)."""


def ts(entry: dict[str, Any]) -> float:
    """A log line's `timestamp` (ISO 8601, UTC) as epoch seconds, on the same clock as time.time()."""
    return datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()


def drive(emu: Emulator, agent: Agent, vm: str, count: int, seed: int, out: dict[str, list[float]]) -> None:
    """`count` events for one agent, one at a time, each created at a random phase of its poll cycle."""
    rng = random.Random(seed)
    session = http()
    for _ in range(count):
        wait_until(lambda: session.get(agent.base + "/probe", timeout=2).status_code == 200, 30, "back in rotation")
        time.sleep(rng.uniform(0, POLL))
        eid = emu.add_event(event_type="Reboot", resources=[vm], notice=8.0)
        created = time.time()
        while session.get(agent.base + "/probe", timeout=2).status_code != 503:
            if time.time() - created > 10:
                raise AssertionError("the probe never answered 503")
            time.sleep(PROBE_EVERY)
        out["probe"].append(time.time() - created)
        started = ts(agent.wait_log("handler.started", timeout=10, event_id=eid, handler="drain"))
        out["handler"].append(started - created)
        polled = max(r["time"] for r in emu.requests(vm) if r["method"] == "GET" and "scheduledevents" in r["path"]
                     and r["time"] <= started)
        out["after_poll"].append(started - polled)  # the poll that saw it is the last one before the handler


def run(quick: bool = False) -> dict[str, Any]:
    per_agent = 4 if quick else 17
    emu = Emulator(list(VMS), "--started-duration", "0.3")
    out: dict[str, list[float]] = {"handler": [], "probe": [], "after_poll": []}
    with tempfile.TemporaryDirectory() as tmp:
        agents = {vm: Agent(Path(tmp) / vm, emu.urls[vm], vm, {
            "imds": {"poll_interval": "1s"}, "log": {"level": "info"},
            "handlers": [{"name": "drain", "type": "drain", "phases": ["scheduled", "completed"]}]})
            for vm in VMS}
        try:
            threads = [threading.Thread(target=drive, args=(emu, agents[vm], vm, per_agent, i, out))
                       for i, vm in enumerate(VMS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for a in agents.values():
                a.stop()
            emu.stop()
    handler, probe, after = summary(out["handler"]), summary(out["probe"]), summary(out["after_poll"])
    target = (POLL + 0.05) * 1000
    return write("detection", {"poll_interval_s": POLL, "events": len(out["handler"]),
                               "to_handler_start_ms": handler, "to_probe_503_ms": probe,
                               "poll_received_to_handler_start_ms": after}, [
        ("event -> handler start p50 / p99", f"{handler['p50']} / {handler['p99']} ms (n={handler['n']})",
         f"p99 <= {target:.0f} ms", handler["p99"] <= target),
        ("event -> probe 503 p50 / p99", f"{probe['p50']} / {probe['p99']} ms (n={probe['n']})",
         f"p99 <= {target:.0f} ms", probe["p99"] <= target),
        ("poll that saw it (received by IMDS) -> handler start p50 / p99", f"{after['p50']} / {after['p99']} ms",
         "≤ 50 ms (what maintd adds)", after["p99"] <= 50),
    ], quick)
