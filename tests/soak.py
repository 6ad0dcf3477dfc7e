"""The soak, shared by its short form in the suite (tests/faults/test_soak.py) and its long form in bench/
(`python -m bench soak`): many polls at a 5 ms interval with events coming and going; memory, fds and threads
stay flat.

The agent first warms up: in the long form until its working set is steady (finished events stay in the state
file for `state.retention`, 60 s, the least allowed, and are pruned within a quarter of it; with the longest
notice 20 s, after 100 s as many events leave as arrive); in the short form until every kind of event (each
type on each set of VMs, so every pool a busy event or a peer starts) has come and gone once, its notices at
most 3 s. Then `polls` polls are measured against the footprint at that point.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.e2e.harness import Agent, Emulator, wait_until

RETENTION = 60.0
LONG_NOTICES = (0.3, 1.0, 20.0)
SHORT_NOTICES = (0.3, 1.0, 3.0)
TYPES = ("Reboot", "Freeze", "Redeploy")
RESOURCES = (("vm-1",), ("vm-2",), ("vm-1", "vm-2"))
KINDS = tuple((t, r) for t in TYPES for r in RESOURCES)
"""Every kind of event: the short form's warm-up adds each once, in this order."""
BATCH = 500
"""Polls between one new event and the next (and between samples)."""
EMULATOR_ARGS = ("--rate-limit", "100000", "--started-duration", "0.2")
AGENT_CONFIG: dict[str, Any] = {
    "imds": {"poll_interval": "5ms", "max_backoff": "50ms"}, "log": {"level": "info"},
    "state": {"retention": f"{RETENTION:g}s"}, "coordination": {"peers": {"vm-2": "http://127.0.0.1:1"}},
    "handlers": [{"name": "note", "type": "health", "phases": ["scheduled", "started", "completed"]}]}


def warm_up_for(notices: tuple[float, ...], steady: bool) -> float:
    """Seconds of warm-up: from the start to a steady population (retention and its pruning, the longest notice),
    or from the last of KINDS added until it has come and gone."""
    return (RETENTION * 1.25 if steady else 0.0) + max(notices) + 5.0


@dataclass(frozen=True)
class Footprint:
    polls: int
    rss_mb: float
    fds: int
    threads: int
    live_events: int


@dataclass(frozen=True)
class Soak:
    warm_up: float
    """Seconds from the first event to the baseline."""
    warm: list[Footprint]
    samples: list[Footprint]

    @property
    def baseline(self) -> Footprint:
        return self.samples[0]

    @property
    def end(self) -> Footprint:
        return self.samples[-1]

    def figures(self) -> dict[str, Any]:
        b, e = self.baseline, self.end
        return {"warm_up_s": round(self.warm_up), "warm_up_polls": b.polls,
                "rss_first_mb": round(self.warm[0].rss_mb if self.warm else b.rss_mb, 1),
                "measured_polls": e.polls - b.polls, "rss_baseline_mb": round(b.rss_mb, 1),
                "rss_end_mb": round(e.rss_mb, 1), "rss_peak_mb": round(max(s.rss_mb for s in self.samples), 1),
                "fds_baseline": b.fds, "fds_end": e.fds, "threads_baseline": b.threads, "threads_end": e.threads,
                "threads_most": max(s.threads for s in self.samples), "live_events_baseline": b.live_events,
                "live_events_end": e.live_events}

    def line(self) -> str:
        f = self.figures()
        return (f"soak: warm-up {f['warm_up_s']}s = {f['warm_up_polls']} polls (RSS {f['rss_first_mb']} -> "
                f"{f['rss_baseline_mb']} MB), then {f['measured_polls']} polls: RSS {f['rss_baseline_mb']} -> "
                f"{f['rss_end_mb']} MB (peak {f['rss_peak_mb']}), fds {f['fds_baseline']} -> {f['fds_end']}, "
                f"threads {f['threads_baseline']} -> {f['threads_end']} (most {f['threads_most']}), "
                f"live events {f['live_events_baseline']} -> {f['live_events_end']}")

    def checks(self) -> list[tuple[str, str, str, bool]]:
        """(figure, measured, target, met): nothing may grow once warm. RSS by less than 2 MB; no more descriptors
        or threads than after the warm-up (bounded pools sized by peers and busy events, not by traffic; +1: a
        handler's helper thread may be alive at the instant sampled)."""
        b, e = self.baseline, self.end
        grew = round(e.rss_mb - b.rss_mb, 2)
        return [("RSS growth (MB)", str(grew), "< 2", grew < 2.0),
                ("file descriptors, warm -> end", f"{b.fds} -> {e.fds}", "no growth", e.fds <= b.fds),
                ("threads, warm -> end", f"{b.threads} -> {e.threads}", "at most +1", e.threads <= b.threads + 1)]


def footprint(pid: int, polls: int, live_events: int) -> Footprint:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(status.split("VmRSS:")[1].split()[0]) / 1024
    return Footprint(polls, rss, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task")),
                     live_events)


def polls_of(agent: Agent) -> int:
    polls: int = agent.get("/v1/status").json()["imds"]["polls"]
    return polls


def soak(emu: Emulator, agent: Agent, polls: int, notices: tuple[float, ...], steady: bool,
         on_sample: Callable[[Footprint], None] = lambda s: None) -> Soak:
    """One new event every BATCH polls (seeded), one sample after each batch, until `polls` polls were measured
    after the warm-up; the agent must stay alive throughout."""
    rng = random.Random(7)
    warm_up = warm_up_for(notices, steady)
    first = [] if steady else list(KINDS)
    began = start = time.monotonic()
    warmed = 0.0
    warm: list[Footprint] = []
    samples: list[Footprint] = []
    while not samples or samples[-1].polls - samples[0].polls < polls:
        if first:
            (kind, on), notice = first.pop(0), notices[len(first) % len(notices)]
            began = time.monotonic()
        else:
            kind, on, notice = rng.choice(TYPES), rng.choice(RESOURCES), rng.choice(notices)
        emu.add_event(event_type=kind, resources=list(on), notice=notice)
        target = polls_of(agent) + BATCH
        wait_until(lambda: polls_of(agent) >= target, 60, f"{target} polls")
        assert agent.proc.poll() is None, "maintd died during the soak"
        sample = footprint(agent.proc.pid, polls_of(agent), len(agent.get("/v1/events").json()))
        if not samples and not first and time.monotonic() - began >= warm_up:
            warmed = time.monotonic() - start
        (samples if warmed else warm).append(sample)
        on_sample(sample)
    return Soak(warmed, warm, samples)
