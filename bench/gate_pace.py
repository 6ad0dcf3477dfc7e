"""Gate queries while an approval is held (issue 28 #5): one real agent whose Prometheus gate holds
the approval for 20 s, first with an alert firing (a stand-in Prometheus on 127.0.0.1 that counts the
queries), then with Prometheus refusing connections (the `gate.check_failed` lines counted).

And how soon a held gate lets go (issue 35 #3): two real agents polling every second (as shipped),
`gates.fleet.max_percent_unhealthy: 0`, the peer reporting Error; once the leader holds the
approval, the report is cleared at a random moment within the periodic recheck (5 s) and the time
from the clear to the StartRequests POST the emulator received is measured, over many events.
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.common import summary, write
from tests.e2e.harness import Agent, Emulator, free_port, wait_until

FIRING = json.dumps({"status": "success", "data": {"alerts": [
    {"labels": {"alertname": "NodeDown"}, "state": "firing"}]}}).encode()


class Prometheus(BaseHTTPRequestHandler):
    queries = 0

    def do_GET(self) -> None:  # http.server's name
        type(self).queries += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(FIRING)))
        self.end_headers()
        self.wfile.write(FIRING)

    def log_message(self, *args: Any) -> None:
        pass


def held_for(seconds: float, url: str, tmp: Path, name: str) -> Agent:
    """An agent whose one event's approval the gate at `url` holds, `seconds` after the first hold."""
    emu = Emulator(["vm-1"])
    agent = Agent(tmp / name, emu.urls["vm-1"], "vm-1",
                  {"gates": {"prometheus": {"url": url, "alerts": ["NodeDown"]}}})
    try:
        eid = emu.add_event(event_type="Reboot", resources=["vm-1"], notice=600)
        agent.wait_log("approval.held", event_id=eid, timeout=30)
        time.sleep(seconds)
    finally:
        agent.stop()
        emu.stop()
    return agent


def cleared_to_post(runs: int, tmp: Path) -> list[float]:
    """Seconds from a peer's cleared Error report to the leader's POST, one per event."""
    emu = Emulator(["vm-1", "vm-2"], "--started-duration", "1")
    ports = {vm: free_port() for vm in ("vm-1", "vm-2")}
    extra = {"imds": {"poll_interval": "1s"}, "gates": {"fleet": {"max_percent_unhealthy": 0}},
             "coordination": {"peers": {vm: f"http://127.0.0.1:{p}" for vm, p in ports.items()},
                              "request_timeout": "500ms"}}
    agents = {vm: Agent(tmp / f"fleet-{vm}", emu.urls[vm], vm, extra, port=port) for vm, port in ports.items()}
    seq = int(time.time() * 1000)
    delays = []
    try:
        for _ in range(runs):
            seq += 2
            report = {"SourceId": "app-watchdog", "Property": "queue", "HealthState": "Error", "SequenceNumber": seq}
            assert agents["vm-2"].post("/v1/health/reports", report).status_code == 200
            eid = emu.add_event(event_type="Reboot", resources=["vm-1", "vm-2"], notice=600)
            agents["vm-1"].wait_log("approval.held", timeout=60, event_id=eid)
            time.sleep(random.uniform(0, 5))  # anywhere within the periodic recheck
            cleared = time.time()
            agents["vm-2"].post("/v1/health/reports", {**report, "HealthState": "Ok", "SequenceNumber": seq + 1})
            posted = wait_until(lambda: [a for a in emu.approvals("vm-1") if eid in a["event_ids"]], 60,
                                f"the POST of {eid}")
            delays.append(posted[0]["time"] - cleared)
            wait_until(lambda: eid not in {e["EventId"] for e in emu.admin("GET", "events")["Events"]}, 60,
                       f"{eid} to end")
    finally:
        for agent in agents.values():
            agent.stop()
        emu.stop()
    return delays


def run(quick: bool = False) -> dict[str, Any]:
    seconds = 10.0 if quick else 20.0
    runs = 8 if quick else 40
    server = ThreadingHTTPServer(("127.0.0.1", 0), Prometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            start = Prometheus.queries
            held_for(seconds, f"http://127.0.0.1:{server.server_address[1]}", Path(tmp), "firing")
            queries = Prometheus.queries - start
        finally:
            server.shutdown()
        failing = held_for(seconds, f"http://127.0.0.1:{free_port()}", Path(tmp), "failing")
        lines = len(failing.events("gate.check_failed"))
        opened = summary(cleared_to_post(runs, Path(tmp)))
    rate = queries / seconds
    return write("gate_pace", {"seconds": seconds, "queries": queries, "queries_per_s": round(rate, 2),
                               "check_failed_lines": lines, "cleared_to_post_ms": opened}, [
        ("Prometheus queries per second while an alert fires", f"{rate:.2f} ({queries} in {seconds:g} s)",
         "<= 0.2/s", rate <= 0.25),
        ("gate.check_failed lines while Prometheus refuses", f"{lines} in {seconds:g} s", "throttled (<= 1/min)",
         lines <= 1),
        ("peer's Error cleared -> POST (fleet gate)",
         f"p50 {opened['p50']:.0f} ms, p99 {opened['p99']:.0f} ms, max {opened['max']:.0f} ms over {opened['n']}",
         "p99 <= 1000 ms", opened["p99"] <= 1000),
    ], quick)


if __name__ == "__main__":
    run()
