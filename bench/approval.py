"""Approval latency with three agents: the last VM becoming ready -> the emulator receiving the POST.

Each agent runs a checkpoint hook that waits for its go-file and writes the time it finished. The
bench releases the hooks in a random order; "ready" is the moment the last hook finished. The
emulator records when the StartRequests POST arrived (same host clock).
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import summary, write
from tests.e2e.harness import Agent, Emulator, free_port, wait_until

VMS = ["vm-1", "vm-2", "vm-3"]
HOOK = ("import os, time\n"
        "go = os.path.join(os.environ['DIR'], os.environ['MAINTD_EVENT_ID'] + '.go')\n"
        "while not os.path.exists(go): time.sleep(0.005)\n"
        "open(os.path.join(os.environ['DIR'], os.environ['MAINTD_EVENT_ID'] + '.' + os.environ['MAINTD_VM_NAME']),"
        " 'w').write(repr(time.time()))\n")


def run(quick: bool = False) -> dict[str, Any]:
    count = 8 if quick else 40
    rng = random.Random(3)
    emu = Emulator(VMS, "--started-duration", "0.3")
    latencies: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        ports = {vm: free_port() for vm in VMS}
        peers = {vm: f"http://127.0.0.1:{p}" for vm, p in ports.items()}
        dirs = {vm: Path(tmp) / f"hooks-{vm}" for vm in VMS}
        agents = {}
        for vm in VMS:
            dirs[vm].mkdir()
            agents[vm] = Agent(Path(tmp) / vm, emu.urls[vm], vm, {
                "imds": {"poll_interval": "1s"}, "log": {"level": "info"},
                "coordination": {"peers": peers, "request_timeout": "500ms"},
                "handlers": [{"name": "checkpoint", "type": "exec", "phases": ["scheduled"],
                              "command": [sys.executable, "-c", HOOK], "env": {"DIR": str(dirs[vm])}}]},
                port=ports[vm])
        try:
            for _ in range(count):
                eid = emu.add_event(event_type="Reboot", resources=VMS, notice=600)
                for vm in VMS:
                    agents[vm].wait_log("handler.started", event_id=eid, timeout=15)
                for vm in rng.sample(VMS, len(VMS)):
                    time.sleep(rng.uniform(0.05, 0.6))
                    (dirs[vm] / f"{eid}.go").touch()
                done = [dirs[vm] / f"{eid}.{vm}" for vm in VMS]
                wait_until(lambda: all(p.exists() and p.read_text() for p in done), 15, "every hook to finish")
                ready = max(float(p.read_text()) for p in done)
                sent = wait_until(lambda: [a for vm in VMS for a in emu.approvals(vm) if eid in a["event_ids"]], 15,
                                  "the POST")
                assert len(sent) == 1
                latencies.append(sent[0]["time"] - ready)
                for vm in VMS:
                    agents[vm].wait_log("handler.finished", event_id=eid, timeout=15)
                time.sleep(rng.uniform(0, 1))
            posts = sum(len(emu.approvals(vm)) for vm in VMS)
        finally:
            for a in agents.values():
                a.stop()
            emu.stop()
    s = summary(latencies)
    return write("approval", {"agents": 3, "events": count, "posts": posts, "ready_to_post_ms": s}, [
        ("last VM ready -> POST received p50 / p99", f"{s['p50']} / {s['p99']} ms (n={s['n']})", "p99 < 500 ms",
         s["p99"] < 500),
        ("POSTs per event", f"{posts / count:.2f}", "exactly 1", posts == count),
    ], quick)
