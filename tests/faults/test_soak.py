"""Soak: many polls at a 5 ms interval with events coming and going; memory, fds and threads stay flat.

CI runs a reduced count; `MAINTD_SOAK_POLLS=100000 ./dev.sh test tests/faults/test_soak.py` runs the
full soak (about ten minutes).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.e2e.harness import wait_until

pytestmark = pytest.mark.e2e

POLLS = int(os.environ.get("MAINTD_SOAK_POLLS", "6000"))


def footprint(pid: int) -> tuple[float, int, int]:
    """(RSS in MB, open fds, threads) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(status.split("VmRSS:")[1].split()[0]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def polls(agent) -> int:
    return agent.get("/v1/status").json()["imds"]["polls"]


def test_soak_memory_fds_and_threads_stay_flat(start_emulator, start_agent):
    """Worker pools and connection pools fill up during the first half (they are bounded); over the
    second half nothing may grow: RSS under 2 MB, no more descriptors or threads."""
    emu = start_emulator(["vm-1", "vm-2"], "--rate-limit", "100000", "--started-duration", "0.2")
    agent = start_agent(emu, "vm-1", {"imds": {"poll_interval": "5ms", "max_backoff": "50ms"},
                                      "log": {"level": "info"}, "state": {"retention": "1m"},
                                      "coordination": {"peers": {"vm-2": "http://127.0.0.1:1"}},
                                      "handlers": [{"name": "note", "type": "health",
                                                    "phases": ["scheduled", "started", "completed"]}]})
    rng = random.Random(7)
    samples: list[tuple[int, tuple[float, int, int]]] = []
    done = 0
    while done < POLLS:
        kind = rng.choice(["Reboot", "Freeze", "Redeploy"])
        emu.add_event(event_type=kind, resources=rng.choice([["vm-1"], ["vm-2"], ["vm-1", "vm-2"]]),
                      notice=rng.choice([0.3, 1.0, 600]))
        target = done + 500
        wait_until(lambda: polls(agent) >= target, 60, f"{target} polls")
        done = polls(agent)
        samples.append((done, footprint(agent.proc.pid)))
        assert agent.proc.poll() is None, "maintd died during the soak"
    start, middle, end = samples[0][1], samples[len(samples) // 2][1], samples[-1][1]
    print(f"soak: {done} polls; RSS {start[0]:.1f} -> {middle[0]:.1f} (half-way) -> {end[0]:.1f} MB, "
          f"fds {start[1]} -> {middle[1]} -> {end[1]}, threads {start[2]} -> {middle[2]} -> {end[2]}")
    assert end[0] - middle[0] < 2.0, f"RSS grew from {middle[0]:.1f} to {end[0]:.1f} MB over the second half"
    assert end[1] <= middle[1] + 1, f"file descriptors grew from {middle[1]} to {end[1]} over the second half"
    # +2: a handler's helper thread and an HTTP connection thread may be alive at the instant sampled
    assert end[2] <= middle[2] + 2, f"threads grew from {middle[2]} to {end[2]} over the second half"
    assert agent.get("/healthz").status_code == 200
