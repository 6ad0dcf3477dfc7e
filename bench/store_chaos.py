"""The store backend's chaos matrix: each fault of tests/store_chaos.py once, on a fresh fleet, one Reboot.

Real agents (poll 100 ms, takeover_after 4 s, debug logs), the emulator, Azurite (in memory) behind one
fault-injecting proxy per VM (tests/store_proxy.py), all on 127.0.0.1. Per fault: StartRequests POSTs
IMDS received and accepted, accepted POSTs before every hook had ended (S1), seconds from the last hook's
end to the approval, store requests the fleet made, and the fault's own figures (requests sent before a
Retry-After had elapsed; RSS, log volume and IMDS poll gaps under a 50 MB listing answer).

`python -m bench store_chaos` writes bench/results/store_chaos.json; `--quick` skips the 50 MB listing.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import write
from tests.azurite import Azurite, start
from tests.e2e.harness import Agent, Emulator
from tests.store_chaos import (
    ODD,
    TAKEOVER,
    Fleet,
    Outcome,
    big_listing,
    latency,
    lost_answers,
    no_fault,
    odd_record,
    paused_claimer,
    paused_preparing,
    start_fleet,
    throttled,
)

THREE, FOUR = (0.3, 0.6, 1.0), (0.3, 0.5, 0.8, 1.2)
"""The hooks' lengths (seconds) of a fleet of three and of four."""
Scenario = tuple[tuple[float, ...], Callable[[Fleet], Outcome]]


def scenarios(quick: bool) -> list[Scenario]:
    found: list[Scenario] = [
        (THREE, no_fault),
        (THREE, lost_answers),
        (THREE, throttled),
        (THREE, lambda f: latency(f, 0.5)),
        (THREE, lambda f: latency(f, 1.5)),
        *[(THREE, lambda f, kind=kind: odd_record(f, kind)) for kind in ODD],
        (FOUR, paused_claimer),
        (FOUR, lambda f: paused_claimer(f, imds_500=True)),
        ((0.3, 0.5, 6.0), lambda f: paused_preparing(f, 3 * TAKEOVER)),
    ]
    return found if quick else [*found, ((0.3,), lambda f: big_listing(f, limit=240.0))]


@contextmanager
def fleet_of(server: Azurite, hooks: tuple[float, ...]) -> Iterator[Fleet]:
    """A fleet on its own temporary directory, every process stopped afterwards."""
    emulators: list[Emulator] = []
    agents: list[Agent] = []

    def start_emulator(vms: list[str]) -> Emulator:
        emulators.append(Emulator(vms))
        return emulators[-1]

    def start_agent(emu: Emulator, name: str, extra: dict[str, Any]) -> Agent:
        agents.append(Agent(Path(tmp) / name, emu.urls[name], name, extra))
        return agents[-1]

    with tempfile.TemporaryDirectory() as tmp:
        fleet = None
        try:
            fleet = start_fleet(start_emulator, start_agent, Path(tmp), server, hooks)
            yield fleet
        finally:
            if fleet is not None:
                fleet.stop()
            for process in [*agents, *emulators]:
                process.stop()


def table(rows: list[dict[str, Any]]) -> str:
    """The matrix as Markdown (RELIABILITY.md carries it)."""
    lines = ["| fault | POSTs received | POSTs accepted | before the last hook | last hook -> POST (s) | "
             "store requests | other |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        other = ", ".join(f"{k} {v}" for k, v in r.items() if k not in (
            "fault", "posts", "approvals", "early", "to_approval_s", "store_requests", "examples"))
        lines.append(f"| {r['fault']} | {r['posts']} | {r['approvals']} | {r['early']} | "
                     f"{'-' if r['to_approval_s'] is None else r['to_approval_s']} | {r['store_requests']} | "
                     f"{other} |")
    return "\n".join(lines)


def run(quick: bool = False) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    checks: list[tuple[str, str, str, bool]] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start(Path(tmp))
        try:
            for hooks, scenario in scenarios(quick):
                with fleet_of(server, hooks) as fleet:
                    result = scenario(fleet)
                rows.append(result.row())
                print(f"  {result.row()}", flush=True)
                checks.append((f"{result.fault}: POSTs accepted, before the last hook", f"{result.approvals}, "
                               f"{result.early}", "1, 0", (result.approvals, result.early) == (1, 0)))
                figures = result.figures
                if "before_retry_after" in figures:
                    checks.append((f"{result.fault}: requests before Retry-After elapsed",
                                   str(figures["before_retry_after"]), "0", figures["before_retry_after"] == 0))
                if "rss_peak_mb" in figures:
                    growth = figures["rss_peak_mb"] - figures["rss_before_mb"]
                    checks.append((f"{result.fault}: peak RSS growth (MB)", str(growth), "< 100", growth < 100))
        finally:
            server.stop()
    print(table(rows), flush=True)
    return write("store_chaos", {"takeover_after_s": TAKEOVER, "rows": rows}, checks, quick)
