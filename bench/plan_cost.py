"""Cost of one plan (`agent.prepare.prepare_plan.make_plan`), which the loop computes when an event appears and again
for every pending event on a reload or a change of the profile in force.

Four profile sets, each with a 7-day Reboot (the longest notice, so the longest search): `default`
(one `auto` profile), `nightly` (business hours `never` + nightly `auto`), `freeze` (a fixed-date
`never` covering NotBefore) and `busy` (two `never` profiles alternating every 30 minutes, and a
Saturday `auto` one: the window is found among 300 profile changes).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from agent.model.events import Event
from agent.policy.approval_policy import parse_profiles
from agent.prepare.prepare_plan import PrepareConfig, make_plan
from bench.common import percentile, write
from bench.parse_cost import timed

NOW = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
EVENT = Event("E1", "Reboot", "Scheduled", ("vm-0",), not_before=NOW + timedelta(days=7))
PREPARE = PrepareConfig(lead_time=1800.0)
HOURLY = {"frequency": "hour", "schedule": {"minutes": [0]}}
PROFILES = {
    "default": parse_profiles(None),
    "nightly": parse_profiles([
        {"name": "business", "approval": "never", "recurrence": {"frequency": "week", "schedule": {
            "week_days": ["monday", "tuesday", "wednesday", "thursday", "friday"], "hours": [8], "minutes": [0]}}},
        {"name": "nightly", "approval": "auto", "recurrence": {"frequency": "day", "schedule": {
            "hours": [22], "minutes": [0]}}},
        {"name": "default", "approval": "never"}]),
    "freeze": parse_profiles([
        {"name": "freeze", "approval": "never", "fixed_date": {
            "start": "2026-01-01T00:00:00Z", "end": "2026-02-01T00:00:00Z"}},
        {"name": "default", "approval": "auto"}]),
    "busy": parse_profiles([
        {"name": "a", "approval": "never", "recurrence": HOURLY},
        {"name": "b", "approval": "never", "recurrence": {"frequency": "hour", "schedule": {"minutes": [30]}}},
        {"name": "saturday", "approval": "auto", "recurrence": {"frequency": "week", "schedule": {
            "week_days": ["saturday"], "hours": [2], "minutes": [10]}}},
        {"name": "default", "approval": "never"}]),
}


def run(quick: bool = False) -> dict[str, Any]:
    rounds = 20 if quick else 300
    samples: dict[str, list[float]] = {name: [] for name in PROFILES}
    for _ in range(rounds):  # the sets in turn, so the machine's noise falls on all of them alike
        for name, profiles in PROFILES.items():
            samples[name].append(timed(lambda: make_plan(EVENT, profiles, PREPARE, NOW))[1])
    rows = {name: {"n": len(cpu), "cpu_p50_ms": round(percentile(cpu, 50), 3),
                   "cpu_p99_ms": round(percentile(cpu, 99), 3)}
            for name, cpu in samples.items()}
    for name, r in rows.items():
        print(f"  {name:8} CPU p50 {r['cpu_p50_ms']} ms, p99 {r['cpu_p99_ms']} ms", flush=True)
    worst = max(r["cpu_p99_ms"] for r in rows.values())
    return write("plan_cost", {"rounds": rounds, "rows": rows}, [
        ("one plan, 7-day Reboot, nightly / freeze / busy profiles: CPU p50",
         " / ".join(f"{rows[n]['cpu_p50_ms']}" for n in ("nightly", "freeze", "busy")) + " ms", "reported", True),
        ("one plan, worst profile set: CPU p99 (the loop plans every pending event on a reload)",
         f"{worst} ms", "< 20 ms", worst < 20),
    ], quick)
