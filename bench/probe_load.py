"""The probe under load: 500 requests/s from another process for 30 s, while the agent polls at 1 Hz.

Reports the probe's latency percentiles and the largest gap between two polls the emulator saw
(target: no gap over 1.5 x the poll interval).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from bench.common import percentile, summary, write
from tests.e2e.harness import CLEAN_ENV, Agent, Emulator

LOAD = textwrap.dedent("""
    import http.client, json, sys, threading, time
    host, port, rate, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    workers = 8
    lat, late, errors = [], [], [0]
    lock = threading.Lock()
    start = time.monotonic() + 0.5
    def worker(k):
        conn = http.client.HTTPConnection(host, port, timeout=5)
        n = 0
        while True:
            due = start + (n * workers + k) / rate
            if due - start > seconds:
                break
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            t0 = time.monotonic()
            try:
                conn.request("GET", "/probe")
                conn.getresponse().read()
                t1 = time.monotonic()
                with lock:  # from sending, and from when it was due (a late send counts: open loop)
                    lat.append(t1 - t0)
                    late.append(t1 - due)
            except Exception:
                errors[0] += 1
                conn = http.client.HTTPConnection(host, port, timeout=5)
            n += 1
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(workers)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps({"latencies": lat, "from_due": late, "errors": errors[0], "seconds": seconds}))
""")


def run(quick: bool = False) -> dict[str, Any]:
    seconds, rate = (8.0 if quick else 30.0), 500.0
    emu = Emulator(["vm-1"])
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(Path(tmp) / "vm-1", emu.urls["vm-1"], "vm-1",
                      {"imds": {"poll_interval": "1s"}, "log": {"level": "info"}})
        try:
            before = len(emu.requests("vm-1"))
            done = subprocess.run([sys.executable, "-c", LOAD, "127.0.0.1", str(agent.port), str(rate), str(seconds)],
                                  capture_output=True, text=True, env=CLEAN_ENV, timeout=seconds + 60)
            result = json.loads(done.stdout)
            polls = [r for r in emu.requests("vm-1")[before:] if "scheduledevents" in r["path"]]
        finally:
            agent.stop()
            emu.stop()
    times = [r["monotonic"] for r in polls]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    s, due = summary(result["latencies"]), summary(result["from_due"])
    achieved = len(result["latencies"]) / seconds
    largest = max(gaps) if gaps else float("nan")
    return write("probe_load", {"rate_target": rate, "rate_achieved": round(achieved, 1), "errors": result["errors"],
                                "probe_latency_ms": s, "probe_latency_from_schedule_ms": due, "polls": len(polls),
                                "poll_gap_s": {"p50": round(percentile(gaps, 50), 3), "max": round(largest, 3)}}, [
        ("probe requests/s achieved (errors)", f"{achieved:.0f} ({result['errors']})", "500 (0)",
         achieved >= 450 and result["errors"] == 0),
        ("probe latency p50 / p99 under load (p99 from the scheduled send)",
         f"{s['p50']} / {s['p99']} ms ({due['p99']} ms)", "reported", True),
        ("largest gap between two polls under load", f"{largest:.3f} s ({len(polls)} polls)", "<= 1.5 s",
         largest <= 1.5),
    ], quick)
