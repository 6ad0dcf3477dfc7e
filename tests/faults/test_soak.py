"""Soak: many polls at a 5 ms interval with events coming and going; memory, fds and threads stay flat.

The agent first warms up until its working set is steady: finished events stay in the state file
for `state.retention` (60 s, the least allowed) and are pruned within a quarter of it, and the
longest notice is 20 s, so after 100 s as many events leave as arrive. Then `MAINTD_SOAK_POLLS`
polls are measured against the footprint at that point. CI runs 6000;
`MAINTD_SOAK_POLLS=100000 ./dev.sh test tests/faults/test_soak.py -s` runs the full soak (about
ten minutes).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.harness import wait_until

pytestmark = pytest.mark.e2e

POLLS = int(os.environ.get("MAINTD_SOAK_POLLS", "6000"))
RETENTION = 60.0
NOTICES = (0.3, 1.0, 20.0)
WARM_UP = RETENTION * 1.25 + max(NOTICES) + 5.0
BATCH = 500
"""Polls between one new event and the next (and between samples)."""


@dataclass(frozen=True)
class Footprint:
    polls: int
    rss_mb: float
    fds: int
    threads: int
    live_events: int


def footprint(pid: int, polls: int, live_events: int) -> Footprint:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(status.split("VmRSS:")[1].split()[0]) / 1024
    return Footprint(polls, rss, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task")),
                     live_events)


def polls(agent) -> int:
    return agent.get("/v1/status").json()["imds"]["polls"]


def test_soak_memory_fds_and_threads_stay_flat(start_emulator, start_agent):
    """Once the event population is steady, nothing may grow: RSS under 2 MB, no more descriptors or
    threads than after the warm-up (bounded pools sized by peers and busy events, not by traffic)."""
    emu = start_emulator(["vm-1", "vm-2"], "--rate-limit", "100000", "--started-duration", "0.2")
    agent = start_agent(emu, "vm-1", {"imds": {"poll_interval": "5ms", "max_backoff": "50ms"},
                                      "log": {"level": "info"}, "state": {"retention": f"{RETENTION:g}s"},
                                      "coordination": {"peers": {"vm-2": "http://127.0.0.1:1"}},
                                      "handlers": [{"name": "note", "type": "health",
                                                    "phases": ["scheduled", "started", "completed"]}]})
    rng = random.Random(7)
    began = time.monotonic()
    warm: list[Footprint] = []
    samples: list[Footprint] = []
    while not samples or samples[-1].polls - samples[0].polls < POLLS:
        emu.add_event(event_type=rng.choice(["Reboot", "Freeze", "Redeploy"]),
                      resources=rng.choice([["vm-1"], ["vm-2"], ["vm-1", "vm-2"]]), notice=rng.choice(NOTICES))
        target = polls(agent) + BATCH
        wait_until(lambda: polls(agent) >= target, 60, f"{target} polls")
        assert agent.proc.poll() is None, "maintd died during the soak"
        sample = footprint(agent.proc.pid, polls(agent), len(agent.get("/v1/events").json()))
        (samples if samples or time.monotonic() - began >= WARM_UP else warm).append(sample)

    baseline, end, peak = samples[0], samples[-1], max(s.rss_mb for s in samples)
    print(f"\nsoak: warm-up {WARM_UP:.0f}s = {baseline.polls} polls (RSS {warm[0].rss_mb:.1f} -> "
          f"{baseline.rss_mb:.1f} MB), then {end.polls - baseline.polls} polls: "
          f"RSS {baseline.rss_mb:.1f} -> {end.rss_mb:.1f} MB (peak {peak:.1f}), fds {baseline.fds} -> {end.fds}, "
          f"threads {baseline.threads} -> {end.threads} (most {max(s.threads for s in samples)}), "
          f"live events {baseline.live_events} -> {end.live_events}")
    assert end.rss_mb - baseline.rss_mb < 2.0, f"RSS grew from {baseline.rss_mb:.1f} to {end.rss_mb:.1f} MB"
    assert end.fds <= baseline.fds, f"file descriptors grew from {baseline.fds} to {end.fds}"
    # +1: a handler's helper thread may be alive at the instant sampled
    assert end.threads <= baseline.threads + 1, f"threads grew from {baseline.threads} to {end.threads}"
    assert agent.get("/healthz").status_code == 200
