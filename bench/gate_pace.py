"""Gate queries while an approval is held (issue 28 #5): one real agent whose Prometheus gate holds
the approval for 20 s, first with an alert firing (a stand-in Prometheus on 127.0.0.1 that counts the
queries), then with Prometheus refusing connections (the `gate.check_failed` lines counted).
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.common import write
from tests.e2e.harness import Agent, Emulator, free_port

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


def run(quick: bool = False) -> dict[str, Any]:
    seconds = 10.0 if quick else 20.0
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
    rate = queries / seconds
    return write("gate_pace", {"seconds": seconds, "queries": queries, "queries_per_s": round(rate, 2),
                               "check_failed_lines": lines}, [
        ("Prometheus queries per second while an alert fires", f"{rate:.2f} ({queries} in {seconds:g} s)",
         "<= 1/s", rate <= 1.0),
        ("gate.check_failed lines while Prometheus refuses", f"{lines} in {seconds:g} s", "throttled (<= 1/min)",
         lines <= 1),
    ], quick)


if __name__ == "__main__":
    run()
