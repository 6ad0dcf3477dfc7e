"""The disruption budget on a simulated group: 200 members, 40 overlapping events of 5 members each.

A discrete-event simulation on a simulated clock: every budget step is the real `budget.step` (read the record,
the pure rules, an If-Match write, again on a conflict) against an in-memory store with the blob store's
conditional writes, each request taking STORE_LATENCY of simulated time. A member's release hands its place to
the next in line in the same write (the real `budget_rules.grant`); the releaser then sends the granted member a
wake hint, delivered HINT_LATENCY later; each try is lost with probability LOST (seeded) and the sender tries again
after the real RETRY_AFTER waits; a member whose hints are all lost, or one no hint reaches (UNREACHABLE), catches
its place on its fallback poll (FALLBACK_POLL, the default `coordination.budget.fallback_poll`). A woken
member reads the record (one TAKE step); once it sees its place it leaves rotation LOOP_LATENCY later (the
loop's tick and preparation's start). A waiting member is forced at the real `last_safe_moment` by local timing,
with no read. A member that holds a place prepares (PREPARE seconds: drain wait and hooks) and renews its place
every release_after / 4 while out; its event is approved once every member it names holds a place or is forced,
maintenance lasts MAINTENANCE, then the member is back and releases its place.

Reported: the most members out at once with the budget and without one (every member leaves at once); from a
release to the next member's place (the grant: in the releaser's own write) and to that member leaving rotation
(it noticed: the honest figure for the target p99 < 2 s), p50/p99, with every hint delivered, with lost tries
and with unreachable members; store requests
per member per event (target <= 10); forced members; events approved before NotBefore. `python -m bench budget`.
"""

from __future__ import annotations

import heapq
import itertools
import random
from datetime import UTC, datetime, timedelta
from typing import Any

from agent.clock import FakeClock
from agent.fleet.budget import Outcome, step
from agent.fleet.budget_rules import (
    FORCE,
    RELEASE,
    RENEW,
    TAKE,
    Me,
    capacity,
    forced_now,
    last_safe_moment,
    parse_places,
    places_blob,
)
from agent.fleet.budget_wake import HINT_TIMEOUT, RETRY_AFTER
from bench.common import percentile, write
from tests.budget_fakes import CasStore

MEMBERS, EVENTS, PER_EVENT = 200, 40, 5
NOTICE, EVERY = 900.0, 15.0
"""Each event gives 15 minutes' notice (a Reboot's minimum); one appears every 15 s (all 40 within 10 min)."""
PREPARE, MAINTENANCE, STORE_LATENCY = 41.0, 60.0, 0.03
MAX_UNAVAILABLE, SPREAD, RELEASE_AFTER = "10%", "zone", 1800.0
FALLBACK_POLL, HINT_LATENCY, LOOP_LATENCY, LOST, UNREACHABLE = 120.0, 0.05, 0.1, 0.05, 0.05
"""The default fallback poll; a hint's way over the network; the loop's tick and preparation's start after the
read that found the place; the fraction of hint tries lost (each try on its own, as a dropped connection); the
fraction of members no hint reaches (a firewall, `advertise: none`)."""
T0 = datetime(2026, 11, 27, tzinfo=UTC)


class Sim:
    def __init__(self, lost: float, unreachable: float = 0.0, seed: int = 30) -> None:
        self.lost, self.random = lost, random.Random(seed)
        self.unreachable = set(self.random.sample(range(MEMBERS), round(unreachable * MEMBERS)))
        self.clock = FakeClock(T0, 0.0)
        self.store = CasStore(self.clock)
        self.queue: list[tuple[float, int, str, int]] = []
        self.seq = itertools.count()
        # a platform wave goes zone by zone: an event names members of one zone
        self.members = [Me(f"m{i:03d}", str(i // PER_EVENT % 3 + 1), str(i % 2), f"http://m{i:03d}:8088")
                        for i in range(MEMBERS)]
        self.index = {me.vm: i for i, me in enumerate(self.members)}
        self.event_of = {i: i // PER_EVENT for i in range(MEMBERS)}
        self.not_before = {e: T0 + timedelta(seconds=e * EVERY + NOTICE) for e in range(EVENTS)}
        self.state: dict[int, str] = {}
        self.out: set[int] = set()
        self.most_out = 0
        self.forced = 0
        self.granted_at: dict[int, float] = {}
        self.grants: list[float] = []
        self.leaves: list[float] = []
        self.hints = {"sent": 0, "lost": 0}
        self.approved_before_nb = 0

    def hint_arrives(self, j: int) -> float | None:
        """Seconds until member j takes its hint: the sender's tries (the real RETRY_AFTER), each lost with
        probability `lost`; None when every try is lost or the member is unreachable (its fallback poll)."""
        if j in self.unreachable:
            return None
        waited = 0.0
        for wait in (0.0, *RETRY_AFTER):
            waited += wait
            if self.random.random() >= self.lost:
                return waited + HINT_LATENCY
            waited += HINT_TIMEOUT  # a lost try is noticed at the sender's timeout
        return None

    def at(self, when: float, what: str, member: int) -> None:
        heapq.heappush(self.queue, (when, next(self.seq), what, member))

    def store_step(self, action: str, i: int) -> Outcome:
        me, started = self.members[i], self.clock.monotonic()
        before = self.store.requests
        done = step(self.store, "web", action, me, f"e{self.event_of[i]}",
                    lambda n: capacity(MAX_UNAVAILABLE, MEMBERS), SPREAD, RELEASE_AFTER)
        self.clock.advance(STORE_LATENCY * (self.store.requests - before))
        for entry in done.granted:  # handed a place in this write: the hint goes out
            j = self.index[entry.vm]
            self.granted_at[j] = started
            self.grants.append(self.clock.monotonic() - started)
            self.hints["sent"] += 1
            delay = self.hint_arrives(j)
            if delay is None:
                self.hints["lost"] += 1
            else:
                self.at(self.clock.monotonic() + delay, "try", j)
        if done.result == "waiting":
            nb = self.not_before[self.event_of[i]]
            until = (last_safe_moment(nb, PREPARE, 0.0) - self.clock.now()).total_seconds()
            self.at(self.clock.monotonic() + FALLBACK_POLL, "try", i)
            if i not in self.state:
                self.state[i] = "waiting"
                self.at(self.clock.monotonic() + until, "try", i)  # the forced path: local timing, no read
        return done

    def run(self) -> None:
        for e in range(EVENTS):
            for i in range(e * PER_EVENT, (e + 1) * PER_EVENT):
                self.at(e * EVERY, "try", i)
        while self.queue:
            when, _, what, i = heapq.heappop(self.queue)
            if when > self.clock.monotonic():
                self.clock.advance(when - self.clock.monotonic())
            getattr(self, what)(i)

    def try_(self, i: int) -> None:
        if self.state.get(i) not in (None, "waiting"):
            return
        nb = self.not_before[self.event_of[i]]
        forced = forced_now("Reboot", nb, PREPARE, 0.0, self.clock.now())
        result = self.store_step(FORCE if forced else TAKE, i).result
        if result in ("acquired", "forced"):
            self.forced += result == "forced"
            if i in self.granted_at:
                self.leaves.append(self.clock.monotonic() + LOOP_LATENCY - self.granted_at[i])
            self.state[i] = "out"
            self.at(self.clock.monotonic() + LOOP_LATENCY, "leave", i)

    def leave(self, i: int) -> None:
        self.out.add(i)
        self.most_out = max(self.most_out, len(self.out))
        self.at(self.clock.monotonic() + PREPARE, "prepared", i)
        self.at(self.clock.monotonic() + RELEASE_AFTER / 4, "renew", i)

    def renew(self, i: int) -> None:
        if self.state.get(i) in ("out", "prepared"):
            self.store_step(RENEW, i)
            self.at(self.clock.monotonic() + RELEASE_AFTER / 4, "renew", i)

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
        self.state[i] = "done"
        self.out.discard(i)
        self.store_step(RELEASE, i)


setattr(Sim, "try", Sim.try_)


def p(values: list[float], q: float) -> float:
    return round(percentile(values, q), 2) if values else 0.0


def simulate(lost: float, unreachable: float = 0.0) -> dict[str, Any]:
    sim = Sim(lost, unreachable)
    sim.run()
    found = sim.store.read_body(places_blob("web"))
    leftover = parse_places(found[0]) if found else None
    return {"most_out_with_budget": sim.most_out, "most_out_without_budget": MEMBERS, "forced": sim.forced,
            "events_approved_before_notbefore": sim.approved_before_nb,
            "release_to_next_place_s": {"p50": p(sim.grants, 50), "p99": p(sim.grants, 99), "n": len(sim.grants)},
            "release_to_next_leaves_rotation_s": {"p50": p(sim.leaves, 50), "p99": p(sim.leaves, 99),
                                                  "max": round(max(sim.leaves, default=0.0), 2),
                                                  "n": len(sim.leaves)},
            "hints": {**sim.hints, "lost_fraction_per_try": lost, "unreachable_members": len(sim.unreachable)},
            "store_requests_total": sim.store.requests,
            "store_requests_per_member_per_event": round(sim.store.requests / MEMBERS, 2),
            "left_in_record": len(leftover.holders) + len(leftover.waiting)
            if leftover and not isinstance(leftover, str) else None}


def run(quick: bool = False) -> dict[str, Any]:
    every, lossy, cut = simulate(0.0), simulate(LOST), simulate(0.0, UNREACHABLE)
    places = capacity(MAX_UNAVAILABLE, MEMBERS)
    figures = {"members": MEMBERS, "events": EVENTS, "members_per_event": PER_EVENT, "notice_s": NOTICE,
               "event_every_s": EVERY, "max_unavailable": MAX_UNAVAILABLE, "spread": SPREAD, "places": places,
               "prepare_s": PREPARE, "maintenance_s": MAINTENANCE, "store_latency_s": STORE_LATENCY,
               "fallback_poll_s": FALLBACK_POLL, "hint_latency_s": HINT_LATENCY, "loop_latency_s": LOOP_LATENCY,
               "hint_retry_after_s": list(RETRY_AFTER), "no_hint_lost": every, "with_lost_hints": lossy,
               "with_unreachable_members": cut}
    scenarios = (("no hint lost", every), (f"{LOST:.0%} of hint tries lost", lossy),
                 (f"{UNREACHABLE:.0%} of members unreachable", cut))
    for name, f in scenarios:
        g, leave = f["release_to_next_place_s"], f["release_to_next_leaves_rotation_s"]
        print(f"  {name}: most out at once {f['most_out_with_budget']} with the budget, {MEMBERS} without; forced "
              f"{f['forced']}; approved before NotBefore {f['events_approved_before_notbefore']}/{EVENTS}; release -> "
              f"next place p50 {g['p50']:.2f} s p99 {g['p99']:.2f} s; -> it leaves rotation p50 {leave['p50']:.2f} s "
              f"p99 {leave['p99']:.2f} s max {leave['max']:.1f} s; {f['store_requests_per_member_per_event']:.1f} "
              f"store requests per member per event", flush=True)
    leave99 = lossy["release_to_next_leaves_rotation_s"]["p99"]
    per = max(f["store_requests_per_member_per_event"] for _, f in scenarios)
    most = max(f["most_out_with_budget"] for _, f in scenarios)
    checks = [("most members out at once (budget 10% of 200), every scenario", str(most), f"<= {places} + forced",
               all(f["most_out_with_budget"] <= places + f["forced"] for _, f in scenarios)),
              (f"release -> next member leaves rotation, p99 ({LOST:.0%} of hint tries lost)", f"{leave99:.2f} s",
               "< 2 s", leave99 < 2.0),
              ("store requests per member per event, worst scenario", f"{per:.1f}", "<= 10", per <= 10)]
    return write("budget", figures, checks, quick)
