"""Model checking B1-B4 and B7 over each member's belief (tests/model/budget_belief.py), for `python -m bench model`:
the suite's runs, every fault with the forced path at a longer horizon, two faults on one path, and each of today's
bugs re-injected (the checker must find each: its counterexample is recorded, the one docs/RELIABILITY.md shows).

Also recorded, as findings rather than checks of the code as it should be: a loop that sleeps longer than the
lease's margin between passes (the lease is checked, and renewals are sent, only in loop passes).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from tests.model import budget_bugs
from tests.model.budget_belief import CLOCKS, CUT, FAULTS, PAUSE, STALE, STORE_DOWN, BeliefModel, outcomes
from tests.model.budget_member import Clock
from tests.model.budget_suite import HORIZON, KNOWN, SUITE
from tests.model.explorer import Result, explore

LONG = 12
"""The bench's horizon: seconds of store time (the suite's is HORIZON)."""
Bug = Callable[[], AbstractContextManager[None]]


def _clock_beyond_the_bound() -> AbstractContextManager[None]:
    return contextlib.nullcontext()


SLOW = tuple(Clock(c.offset, -0.25) for c in CLOCKS)
FAST = tuple(Clock(c.offset, 0.01) for c in CLOCKS)
"""Clocks at the other end of the bound: leases end sooner, polls come sooner."""
REINJECTED: dict[str, tuple[Bug, tuple[str, ...], str, dict[str, Any]]] = {
    "renew of a missing holder reported renewed (finding 2), a pause": (
        budget_bugs.renew_reports_renewed, (PAUSE,), "B1", {}),
    "renew of a missing holder reported renewed (finding 2), a partition": (
        budget_bugs.renew_reports_renewed, (CUT,), "B2", {}),
    "the dropped force step (finding 3)": (budget_bugs.force_step_dropped, (CUT,), "B3", {}),
    "handoff by hint only (finding 1): no head-of-line reads": (budget_bugs.no_head_of_line_reads, (), "handoff",
                                                                 {"horizon": HORIZON + 2}),
    "handoff by hint only: granted without a write of its own (before B1)": (
        budget_bugs.granted_without_own_write, (), "B1", {}),
    "a member's clock 25 % slow (the bound is 1 %)": (_clock_beyond_the_bound, (CUT,), "B2", {"clocks": SLOW}),
    "a release on the first pass back in rotation (before B7), a wake hint": (
        budget_bugs.release_on_the_first_pass_back, (), "B7", {"hints": True}),
}


def _line(key: str, r: Result) -> str:
    return (f"  {key}: {r.states} states, {r.transitions} transitions, depth {r.depth}, {r.cpu_seconds:.1f} s CPU "
            f"({r.seconds:.1f} s), complete {r.complete}, broken {sorted(r.violations) or 'none'}")


def run() -> tuple[dict[str, Any], list[tuple[str, str, str, bool]]]:
    """(figures, checks) of the belief model."""
    figures: dict[str, Any] = {"known_findings": dict(KNOWN), "horizon_suite": HORIZON, "horizon_bench": LONG}
    checks: list[tuple[str, str, str, bool]] = []
    started, cpu = time.monotonic(), time.process_time()
    runs: dict[str, tuple[int | str, str, tuple[str, ...], bool, int, int]] = {
        f"suite: {name}": (cap, spread, tuple(kinds), forced, HORIZON, 1) for name, (cap, spread, kinds, forced)
        in SUITE.items()}
    suite_keys = list(runs)
    runs.update({
        "suite: 50 % with stale members": ("50%", "none", (STALE,), True, 6, 1),
        "cap 1, every fault, forced path": (1, "none", FAULTS, True, LONG, 1),
        "cap 2 spread zone, every fault, forced path": (2, "zone", FAULTS, True, LONG, 1),
        "cap 1, two of pause / cut off on one path": (1, "none", (PAUSE, CUT), True, 10, 2),
    })
    runs["cap 1, the store failing, the members' clocks 1 % fast"] = (1, "none", (CUT, STORE_DOWN), True, 10, 1)
    for key, (cap, spread, kinds, forced, horizon, faults) in runs.items():
        clocks = FAST if "fast" in key else CLOCKS
        r = explore(BeliefModel(cap, spread, kinds=kinds, horizon=horizon, forced=forced, max_faults=faults,
                                clocks=clocks), outcomes=outcomes())
        figures[key] = r.figures()
        print(_line(key, r), flush=True)
        broken = {p for p in r.violations if p not in KNOWN}
        known = sorted(set(r.violations) - broken)
        checks.append((f"beliefs {key}: properties broken ({r.states} states, {r.cpu_seconds:.1f} s CPU)",
                       (", ".join(sorted(broken)) or "none") + (f" (known findings: {', '.join(known)})" if known
                                                                else ""), "none", not broken and r.complete))
        if key == suite_keys[-1]:
            suite_cpu = time.process_time() - cpu
    for key, (bug, kinds, prop, kw) in REINJECTED.items():
        with bug():
            r = explore(BeliefModel(1, "none", kinds=kinds, **{"hints": False, "horizon": HORIZON + 1, **kw}),
                        max_states=200_000, until=prop)
        found = r.violations.get(prop)
        figures[f"re-injected: {key}"] = {"states": r.states, "property": prop,
                                          "counterexample": found.render() if found else None}
        print(f"  re-injected {key}: {prop} {'found' if found else 'NOT FOUND'} after {r.states} states", flush=True)
        if found:
            print(found.render(), flush=True)
        checks.append((f"beliefs re-injected {key}: {prop} found", "yes" if found else "no", "yes", found is not None))
    for every in (2, 5):
        r = explore(BeliefModel(1, "none", kinds=(CUT,), horizon=LONG, forced=False, hints=False, pass_every=every),
                    until="B2")
        found = r.violations.get("B2")
        figures[f"finding: a loop pass every {every} s"] = {"states": r.states,
                                                            "counterexample": found.render() if found else None}
        print(f"  finding, a loop pass every {every} s (lease margin 2.08 s): B2 "
              f"{'broken' if found else 'holds'} ({r.states} states)", flush=True)
        if found:
            print(found.render(), flush=True)
    figures["suite_cpu_seconds"] = round(suite_cpu, 2)
    figures["total_seconds"] = round(time.monotonic() - started, 2)
    checks.append(("beliefs: the suite's runs, CPU", f"{suite_cpu:.1f} s", "< 25 s", suite_cpu < 25))
    return figures, checks
