"""What `maintd watch` costs: one view (three answers over the unix socket, then the text) and the daemon's CPU
while a watch runs on a terminal (a pty), against the same daemon left alone.

A real `maintd run` with the emulator, an event for three VMs being prepared (a hook running), so the view has
an event, handlers, an approval line and peers to show.
"""

from __future__ import annotations

import argparse
import os
import pty
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agent.cli.cliclient import watch_answers
from agent.cli.cliwatch import screen
from bench.common import cpu_seconds, summary, write
from tests.e2e.harness import CLEAN_ENV, Agent, Emulator, wait_until


def _drain(fd: int) -> None:
    """Read the terminal's output so the watch never blocks on a full pty."""
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass


def run(quick: bool = False) -> dict[str, Any]:
    views, seconds = (30, 5.0) if quick else (300, 30.0)
    emu = Emulator(["vm-1", "vm-2", "vm-3"])
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(Path(tmp) / "vm-1", emu.urls["vm-1"], "vm-1", {
            "imds": {"poll_interval": "1s"}, "log": {"level": "info"},
            "handlers": [{"name": "checkpoint", "type": "exec", "phases": ["scheduled"], "command": ["sleep", "600"],
                          "timeout": "15m"}]})
        try:
            emu.add_event(event_type="Reboot", resources=["vm-1", "vm-2", "vm-3"], notice=900)
            agent.wait_log("handler.started", timeout=30)
            args = argparse.Namespace(config=str(agent.config_path), url=None)
            took = []
            for _ in range(views):
                t0 = time.perf_counter()
                screen(*watch_answers(args), datetime.now(UTC))
                took.append(time.perf_counter() - t0)
            pid = agent.proc.pid
            c0 = cpu_seconds(pid)
            time.sleep(seconds)
            alone = (cpu_seconds(pid) - c0) / seconds
            master, slave = pty.openpty()
            threading.Thread(target=_drain, args=(master,), daemon=True).start()
            watch = subprocess.Popen([sys.executable, "-m", "agent", "watch", "--config", str(agent.config_path)],
                                     stdin=slave, stdout=slave, stderr=subprocess.DEVNULL, env=CLEAN_ENV)
            try:
                wait_until(lambda: cpu_seconds(watch.pid) > 0, 30, "the watch to start")
                time.sleep(2.0)  # past its start-up
                c0, w0 = cpu_seconds(pid), cpu_seconds(watch.pid)
                time.sleep(seconds)
                watched, own = (cpu_seconds(pid) - c0) / seconds, (cpu_seconds(watch.pid) - w0) / seconds
            finally:
                watch.send_signal(2)
                watch.wait(10)
                os.close(slave)
                os.close(master)
        finally:
            agent.stop()
            emu.stop()
    s = summary(took)
    extra = (watched - alone) * 100
    return write("cli_watch", {"views": views, "view_ms": s, "seconds": seconds,
                               "daemon_cpu_percent_alone": round(alone * 100, 2),
                               "daemon_cpu_percent_watched": round(watched * 100, 2),
                               "watch_cpu_percent": round(own * 100, 2)}, [
        ("one view: three answers over the unix socket and the text, p50 / p99", f"{s['p50']} / {s['p99']} ms",
         "< 100 ms p99 (a redraw each second)", s["p99"] < 100),
        ("the daemon's CPU while watched, more than alone", f"{extra:+.2f} % of a core", "< 2 %", extra < 2),
        ("the watch's own CPU", f"{own * 100:.2f} % of a core", "< 5 %", own < 0.05),
    ], quick)
