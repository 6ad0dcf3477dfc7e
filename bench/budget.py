"""The disruption budget on a simulated group: 200 members, 40 overlapping events of 5 members each.

A discrete-event simulation on a simulated clock: every budget step is the real `budget.step` (read the
record, the pure rules, an If-Match write, again on a conflict) against an in-memory store with the blob
store's conditional writes, each request taking STORE_LATENCY of simulated time; a waiting member reads again
after the real `poll_delay`, and is forced at the real `last_safe_moment`. A member that holds a place
prepares (PREPARE seconds: drain wait and hooks), its event is approved once every member it names holds a
place or is forced, maintenance lasts MAINTENANCE, then the member is back and releases its place.

Reported: the most members out at once with the budget and without one (every member leaves at once), the
time from the last release to the place of a member that was waiting (p50/p99; target p99 < 2 s), and store requests
per member per event (target <= 10). `python -m bench budget`.
"""

from __future__ import annotations

import heapq
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

from agent.clock import FakeClock
from agent.coordination.store.budget import step
from agent.coordination.store.budget_rules import (
    FORCE,
    RELEASE,
    TAKE,
    Me,
    capacity,
    forced_now,
    parse_places,
    places_blob,
    poll_delay,
    position,
)
from bench.common import percentile, write
from tests.budget_fakes import CasStore

MEMBERS, EVENTS, PER_EVENT = 200, 40, 5
NOTICE, EVERY = 900.0, 15.0
"""Each event gives 15 minutes' notice (a Reboot's minimum); one appears every 15 s (all 40 within 10 min)."""
PREPARE, MAINTENANCE, STORE_LATENCY = 41.0, 60.0, 0.03
MAX_UNAVAILABLE, SPREAD, RELEASE_AFTER = "10%", "zone", 1800.0
T0 = datetime(2026, 11, 27, tzinfo=UTC)


class Sim:
    def __init__(self) -> None:
        self.clock = FakeClock(T0, 0.0)
        self.store = CasStore(self.clock)
        self.queue: list[tuple[float, int, str, int]] = []
        self.seq = itertools.count()
        # a platform wave goes zone by zone: an event names members of one zone
        self.members = [Me(f"m{i:03d}", str(i // PER_EVENT % 3 + 1), str(i % 2)) for i in range(MEMBERS)]
        self.event_of = {i: i // PER_EVENT for i in range(MEMBERS)}
        self.not_before = {e: T0 + timedelta(seconds=e * EVERY + NOTICE) for e in range(EVENTS)}
        self.state: dict[int, str] = {}
        self.out: set[int] = set()
        self.most_out = 0
        self.forced = 0
        self.last_release: float | None = None
        self.waited: set[int] = set()
        self.handoffs: list[float] = []
        self.approved_before_nb = 0

    def at(self, when: float, what: str, member: int) -> None:
        heapq.heappush(self.queue, (when, next(self.seq), what, member))

    def store_step(self, action: str, i: int) -> str:
        me = self.members[i]
        before = self.store.requests
        done = step(self.store, "web", action, me, f"e{self.event_of[i]}",
                    lambda n: capacity(MAX_UNAVAILABLE, MEMBERS), SPREAD, RELEASE_AFTER)
        self.clock.advance(STORE_LATENCY * (self.store.requests - before))
        if done.result == "waiting":
            places = done.places
            delay = poll_delay(position(places, me.vm) if places else 0, capacity(MAX_UNAVAILABLE, MEMBERS))
            self.at(self.clock.monotonic() + delay, "try", i)
        return done.result

    def run(self) -> dict[str, Any]:
        for e in range(EVENTS):
            for i in range(e * PER_EVENT, (e + 1) * PER_EVENT):
                self.at(e * EVERY, "try", i)
        while self.queue:
            when, _, what, i = heapq.heappop(self.queue)
            if when > self.clock.monotonic():
                self.clock.advance(when - self.clock.monotonic())
            getattr(self, what)(i)
        return {}

    def try_(self, i: int) -> None:
        if self.state.get(i) in ("out", "done"):
            return
        nb = self.not_before[self.event_of[i]]
        forced = forced_now("Reboot", nb, PREPARE, 0.0, self.clock.now())
        result = self.store_step(FORCE if forced else TAKE, i)
        if result == "waiting":
            self.waited.add(i)
        if result in ("acquired", "forced"):
            self.forced += result == "forced"
            if i in self.waited and result == "acquired" and self.last_release is not None:
                self.handoffs.append(self.clock.monotonic() - self.last_release)
            self.state[i] = "out"
            self.out.add(i)
            self.most_out = max(self.most_out, len(self.out))
            self.at(self.clock.monotonic() + PREPARE, "prepared", i)

    def prepared(self, i: int) -> None:
        self.state[i] = "prepared"
        e = self.event_of[i]
        names = range(e * PER_EVENT, (e + 1) * PER_EVENT)
        if all(self.state.get(n) == "prepared" for n in names):  # every member holds a place or is forced
            if self.clock.now() < self.not_before[e]:
                self.approved_before_nb += 1
            for n in names:
                self.at(self.clock.monotonic() + MAINTENANCE, "back", n)
        elif self.clock.now() >= self.not_before[e]:  # Azure starts the event at NotBefore
            for n in names:
                self.at(self.clock.monotonic() + MAINTENANCE, "back", n)

    def back(self, i: int) -> None:
        if self.state.get(i) == "done":
            return
        self.store_step(RELEASE, i)
        self.state[i] = "done"
        self.out.discard(i)
        self.last_release = self.clock.monotonic()


setattr(Sim, "try", Sim.try_)


def run(quick: bool = False) -> dict[str, Any]:
    sim = Sim()
    sim.run()
    found = sim.store.read_body(places_blob("web"))
    leftover = parse_places(found[0]) if found else None
    handoff = sorted(sim.handoffs)
    p50, p99 = (percentile(handoff, 50), percentile(handoff, 99)) if handoff else (0.0, 0.0)
    per = sim.store.requests / MEMBERS
    figures = {"members": MEMBERS, "events": EVENTS, "members_per_event": PER_EVENT, "notice_s": NOTICE,
               "event_every_s": EVERY, "max_unavailable": MAX_UNAVAILABLE, "spread": SPREAD,
               "places": capacity(MAX_UNAVAILABLE, MEMBERS), "prepare_s": PREPARE, "maintenance_s": MAINTENANCE,
               "store_latency_s": STORE_LATENCY, "most_out_with_budget": sim.most_out,
               "most_out_without_budget": MEMBERS, "forced": sim.forced,
               "events_approved_before_notbefore": sim.approved_before_nb,
               "release_to_next_place_s": {"p50": round(p50, 2), "p99": round(p99, 2), "n": len(handoff)},
               "store_requests_total": sim.store.requests, "store_requests_per_member_per_event": round(per, 2),
               "left_in_record": len(leftover.holders) if leftover and not isinstance(leftover, str) else None}
    print(f"  most out at once: {sim.most_out} with the budget, {MEMBERS} without; forced {sim.forced}; "
          f"release -> next place p50 {p50:.2f} s p99 {p99:.2f} s; {per:.1f} store requests per member per event",
          flush=True)
    checks = [("most members out at once (budget 10% of 200)", str(sim.most_out),
               f"<= {capacity(MAX_UNAVAILABLE, MEMBERS)} + forced", sim.most_out <= figures["places"] + sim.forced),
              ("release -> next member's place, p99", f"{p99:.2f} s", "< 2 s", p99 < 2.0),
              ("store requests per member per event", f"{per:.1f}", "<= 10", per <= 10)]
    return write("budget", figures, checks, quick)
