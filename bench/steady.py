"""Steady-state cost of polling at 1 Hz: maintd beside the documentation's naive poller, same run."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import cpu_seconds, peak_rss_mb, write
from tests.e2e.harness import CLEAN_ENV, Agent, Emulator

WARMUP = 5.0


def run(quick: bool = False) -> dict:
    seconds = 15.0 if quick else 60.0
    emu = Emulator(["vm-1", "vm-2"])
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(Path(tmp) / "vm-1", emu.urls["vm-1"], "vm-1",
                      {"imds": {"poll_interval": "1s"}, "log": {"level": "info"}})
        naive = subprocess.Popen([sys.executable, str(Path(__file__).with_name("naive_poller.py")), emu.urls["vm-2"]],
                                 env=CLEAN_ENV, stderr=subprocess.DEVNULL)
        try:
            time.sleep(WARMUP)
            pids = {"maintd": agent.proc.pid, "naive": naive.pid}
            start = {k: cpu_seconds(p) for k, p in pids.items()}
            t0 = time.monotonic()
            time.sleep(seconds)
            wall = time.monotonic() - t0
            cpu = {k: 100 * (cpu_seconds(p) - start[k]) / wall for k, p in pids.items()}
            rss = {k: peak_rss_mb(p) for k, p in pids.items()}
            polls = {vm: len([r for r in emu.requests(vm) if "scheduledevents" in r["path"]]) for vm in ("vm-1", "vm-2")}
        finally:
            naive.kill()
            agent.stop()
            emu.stop()
    figures = {"seconds": round(wall, 1), "cpu_percent": {k: round(v, 3) for k, v in cpu.items()},
               "peak_rss_mb": {k: round(v, 1) for k, v in rss.items()},
               "cpu_ratio_maintd_to_naive": round(cpu["maintd"] / cpu["naive"], 2) if cpu["naive"] else None,
               "polls": polls}
    return write("steady", figures, [
        ("maintd CPU at 1 Hz (% of one core)", f"{cpu['maintd']:.3f} %", "< 0.5 %", cpu["maintd"] < 0.5),
        ("maintd peak RSS", f"{rss['maintd']:.1f} MB", "< 40 MB", rss["maintd"] < 40),
        ("naive poller CPU / RSS (same run)", f"{cpu['naive']:.3f} % / {rss['naive']:.1f} MB", "reference", True),
        ("CPU ratio maintd / naive", f"{figures['cpu_ratio_maintd_to_naive']}", "reported", True),
    ])
