"""The disruption budget on a simulated group, with every wake hint lost: 200 members and 40 overlapping events of
5 members each, and 1000 members and 200 events.

A discrete-event simulation on a simulated clock: every budget step is the real `budget.step` (read the record,
the pure rules, an If-Match write, again on a conflict) against an in-memory store with the blob store's
conditional writes and reads (If-None-Match: a 304 carries no body), each request taking STORE_LATENCY of
the member's time; the members' requests run side by side, as a blob serves hundreds a second (a step is
taken at once in the store's state, so no If-Match conflict is simulated). A release hands its place to the next
in line in the same write (the real `budget_rules.grant`); the granted member confirms with a take of its own once
it reads the record. The handoff needs no traffic between members (B4, decision 0230): the members a write could
seat next read the record every HEAD_POLL_S with a conditional read, the rest every ROUND_POLL_S per round of the
line ahead of them, at most FALLBACK_POLL (the real `budget_poll.poll_after`, on the record each last read). With
`hints`, the releaser also sends the granted member a wake hint, delivered HINT_LATENCY later (the accelerator;
off by default, as with no `wake_url`). A member that sees its place leaves rotation LOOP_LATENCY later (the
loop's tick and preparation's start). A waiting member is forced at the real `last_safe_moment` by local timing
(its FORCE step written first). A holder prepares (PREPARE seconds), renews every release_after / 4 while out;
its event is approved once every member it names holds a place or is forced; maintenance lasts MAINTENANCE; then
it releases its place. An idle member refreshes its stamp every MEMBER_TTL / 3 (a read step that rewrites it).

Reported per scale: the most members out at once, from a release to the next member out of rotation (p50/p99:
target p99 < 2 s with every hint lost), store requests per member per event, and requests per second on the
group's one blob (target: under 10 % of Azure's 500 requests/s per blob, 50/s, at 1000 members).
`python -m bench budget`.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from agent.clock import FakeClock
from agent.fleet.budget_poll import HEAD_MAX, HEAD_POLL_S, RATE_TARGET, ROUND_POLL_S, poll_after
from agent.fleet.budget_records import LastRead
from agent.fleet.budget_rules import (
    FORCE,
    MEMBER_TTL,
    READ,
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
from agent.fleet.budget_step import Outcome, step
from bench.common import percentile, write
from tests.budget_fakes import CasStore

NOTICE = 900.0
"""Each event gives 15 minutes' notice (a Reboot's minimum)."""
PREPARE, MAINTENANCE, STORE_LATENCY = 41.0, 60.0, 0.03
MAX_UNAVAILABLE, SPREAD, RELEASE_AFTER = "10%", "zone", 1800.0
FALLBACK_POLL = 120.0
"""`fallback_poll`'s default: the longest a waiter goes between two reads."""
HINT_LATENCY, LOOP_LATENCY, POLL = 0.05, 0.1, 1.0
"""A hint's way over the network; the loop's tick and preparation's start; IMDS's poll (a member sees its event
within it)."""
T0 = datetime(2026, 11, 27, tzinfo=UTC)


@dataclass(frozen=True)
class Scale:
    members: int
    events: int
    every: float
    """Seconds between two events' appearance."""
    per_event: int = 5


SCALES = {200: Scale(200, 40, 15.0), 1000: Scale(1000, 200, 3.0)}
"""All the events of a scale appear within 10 minutes and overlap (15 minutes' notice each)."""


class Sim:
    def __init__(self, scale: Scale, hints: bool = False, seed: int = 30) -> None:
        self.scale, self.hints, self.random = scale, hints, random.Random(seed)
        self.clock = FakeClock(T0, 0.0)
        self.store = CasStore(self.clock)
        self.blob = places_blob("web")
        self.queue: list[tuple[float, int, str, int]] = []
        self.seq = itertools.count()
        n, per = scale.members, scale.per_event
        # a platform wave goes zone by zone: an event names members of one zone
        self.members = [Me(f"m{i:04d}", str(i // per % 3 + 1), str(i % 2)) for i in range(n)]
        self.index = {me.vm: i for i, me in enumerate(self.members)}
        self.event_of = {i: i // per for i in range(n)}
        # each event appears at a moment of its own within its slot, and each member sees it at its own poll
        self.appears = {e: (e + self.random.random()) * scale.every for e in range(scale.events)}
        self.not_before = {e: T0 + timedelta(seconds=self.appears[e] + NOTICE) for e in range(scale.events)}
        self.state: dict[int, str] = {}
        self.last = [LastRead() for _ in range(n)]
        """What each member last read or wrote of the record (its conditional reads ask If-None-Match on it)."""
        self.out: set[int] = set()
        self.most_out = 0
        self.forced = 0
        self.granted_at: dict[int, float] = {}
        self.latency = 0.0
        """The last step's time on the store (its requests x STORE_LATENCY)."""
        self.leaves: list[float] = []
        self.approved_before_nb = 0
        self.end = (scale.events + 1) * scale.every + NOTICE + PREPARE + MAINTENANCE

    def at(self, when: float, what: str, member: int) -> None:
        heapq.heappush(self.queue, (when, next(self.seq), what, member))

    def cap(self, n: int) -> int:
        return capacity(MAX_UNAVAILABLE, n)

    def store_step(self, action: Any, i: int) -> Outcome:
        """The step, taken at once in the store's state; its requests' time is the member's own (`latency`: what
        follows from it comes that much later), never the others'."""
        before = self.store.requests
        done = step(self.store, "web", action, self.members[i], f"e{self.event_of[i]}", self.cap, SPREAD,
                    RELEASE_AFTER, self.clock.monotonic, self.last[i], MEMBER_TTL)
        self.latency = STORE_LATENCY * (self.store.requests - before)
        for entry in done.granted:  # handed a place in this write, which landed at the end of the step
            j = self.index[entry.vm]
            self.granted_at.setdefault(j, self.clock.monotonic() + self.latency)
            if self.hints:
                self.at(self.clock.monotonic() + self.latency + HINT_LATENCY, "look", j)
        return done

    def run(self) -> None:
        for e in range(self.scale.events):
            for i in range(e * self.scale.per_event, (e + 1) * self.scale.per_event):
                self.at(self.appears[e] + self.random.uniform(0.0, POLL), "want", i)
        # every member ran before the wave (it is counted among the members), and refreshes its stamp on a phase
        # of its own
        for i in range(self.scale.members):
            self.store_step(READ, i)
            self.at(self.random.uniform(0, MEMBER_TTL / 3), "stamp", i)
        self.store.requests, self.store.ops, self.store.at = 0, [], []  # the wave's requests only
        while self.queue:
            when, _, what, i = heapq.heappop(self.queue)
            if when > self.end and what == "stamp":
                continue
            if when > self.clock.monotonic():
                self.clock.advance(when - self.clock.monotonic())
            getattr(self, what)(i)

    # --- a member's life ------------------------------------------------------------------------------

    def want(self, i: int) -> None:
        nb = self.not_before[self.event_of[i]]
        until = (last_safe_moment(nb, PREPARE, 0.0) - self.clock.now()).total_seconds()
        self.at(self.clock.monotonic() + max(0.0, until) + 0.001, "force", i)  # local timing, no read
        self.take(i)

    def take(self, i: int) -> None:
        """A take step; a waiter's polls are take steps too, each read conditional on the ETag it last saw (a 304
        costs no body: the step decides on the record it kept)."""
        if self.state.get(i) not in (None, "waiting"):
            return
        done = self.store_step(TAKE, i)
        if done.result == "acquired":
            self.leave_soon(i)
        elif done.result == "waiting":
            self.state[i] = "waiting"
            places = done.places
            cap = self.cap(len(places.members) if places is not None else 1)
            self.at(self.clock.monotonic() + self.latency + poll_after(places, self.members[i].vm, cap, SPREAD,
                                                                       FALLBACK_POLL, RELEASE_AFTER), "look", i)

    def look(self, i: int) -> None:
        if self.state.get(i) == "waiting":
            self.take(i)

    def force(self, i: int) -> None:
        if self.state.get(i) not in (None, "waiting"):
            return
        nb = self.not_before[self.event_of[i]]
        if not forced_now("Reboot", nb, PREPARE, 0.0, self.clock.now()):  # the clocks' float sums: a hair early
            self.at(self.clock.monotonic() + 0.01, "force", i)
            return
        done = self.store_step(FORCE, i)
        self.forced += done.result == "forced"
        self.leave_soon(i)

    def leave_soon(self, i: int) -> None:
        """Out of rotation once the step that seated it has answered and the loop has ticked."""
        at = self.clock.monotonic() + self.latency + LOOP_LATENCY
        if i in self.granted_at:
            self.leaves.append(at - self.granted_at.pop(i))
        self.state[i] = "out"
        self.at(at, "leave", i)

    def leave(self, i: int) -> None:
        self.out.add(i)
        self.most_out = max(self.most_out, len(self.out))
        self.at(self.clock.monotonic() + PREPARE, "prepared", i)
        self.at(self.clock.monotonic() + RELEASE_AFTER / 4, "renew", i)

    def renew(self, i: int) -> None:
        if self.state.get(i) in ("out", "prepared"):
            self.store_step(RENEW, i)
            self.at(self.clock.monotonic() + RELEASE_AFTER / 4, "renew", i)

    def stamp(self, i: int) -> None:
        if self.state.get(i) is None or self.state.get(i) == "done":
            self.store_step(READ, i)
        self.at(self.clock.monotonic() + MEMBER_TTL / 3, "stamp", i)

    def prepared(self, i: int) -> None:
        self.state[i] = "prepared"
        e, per = self.event_of[i], self.scale.per_event
        names = range(e * per, (e + 1) * per)
        ready = all(self.state.get(n) == "prepared" for n in names)  # every member holds a place or is forced
        if ready and self.clock.now() < self.not_before[e]:
            self.approved_before_nb += 1
        if ready or self.clock.now() >= self.not_before[e]:  # approved, or Azure starts it at NotBefore
            for n in names:
                self.at(self.clock.monotonic() + MAINTENANCE, "back", n)

    def back(self, i: int) -> None:
        if self.state.get(i) == "done":
            return
        self.state[i] = "done"
        self.out.discard(i)
        self.store_step(RELEASE, i)


def p(values: list[float], q: float) -> float:
    return round(percentile(values, q), 2) if values else 0.0


def per_second(at: list[float]) -> dict[str, float]:
    """Requests per second on the blob, over each simulated second from the first request to the last: the mean,
    the busiest 10 s (sustained: what a per-blob target is about) and the busiest second."""
    buckets = Counter(int(t) for t in at)
    span = range(min(buckets, default=0), max(buckets, default=0) + 1)
    rates = [float(buckets.get(s, 0)) for s in span]
    tens = [sum(rates[k:k + 10]) / 10 for k in range(max(1, len(rates) - 9))]
    return {"mean": round(sum(rates) / max(1, len(rates)), 2), "busiest_10s": round(max(tens, default=0.0), 1),
            "busiest_second": max(rates, default=0.0), "p99_second": p(rates, 99)}


def simulate(scale: Scale, hints: bool = False) -> dict[str, Any]:
    sim = Sim(scale, hints)
    sim.run()
    found = sim.store.blobs.get(sim.blob)
    leftover = parse_places(found[0]) if found else None
    ops = Counter(sim.store.ops)
    return {"members": scale.members, "events": scale.events, "event_every_s": scale.every,
            "places": capacity(MAX_UNAVAILABLE, scale.members), "hints": "delivered" if hints else "every one lost",
            "most_out_with_budget": sim.most_out, "most_out_without_budget": scale.members, "forced": sim.forced,
            "events_approved_before_notbefore": sim.approved_before_nb,
            "release_to_next_leaves_rotation_s": {"p50": p(sim.leaves, 50), "p99": p(sim.leaves, 99),
                                                  "max": round(max(sim.leaves, default=0.0), 2),
                                                  "n": len(sim.leaves)},
            "store_requests_total": sim.store.requests, "store_requests_by_kind": dict(ops),
            "store_requests_per_member_per_event": round(sim.store.requests / scale.members, 2),
            "blob_requests_per_s": per_second(sim.store.at),
            "left_in_record": len(leftover.holders) + len(leftover.waiting)
            if leftover and not isinstance(leftover, str) else None}


def run(quick: bool = False) -> dict[str, Any]:
    runs = {"200_hints_lost": simulate(SCALES[200])}
    if not quick:  # quick: the 200 members with every hint lost only
        runs |= {"200_hints_delivered": simulate(SCALES[200], hints=True), "1000_hints_lost": simulate(SCALES[1000])}
    figures = {"notice_s": NOTICE, "max_unavailable": MAX_UNAVAILABLE, "spread": SPREAD, "prepare_s": PREPARE,
               "maintenance_s": MAINTENANCE, "store_latency_s": STORE_LATENCY, "fallback_poll_s": FALLBACK_POLL,
               "head_poll_s": HEAD_POLL_S, "head_max": HEAD_MAX, "round_poll_s": ROUND_POLL_S,
               "member_ttl_s": MEMBER_TTL,
               "hint_latency_s": HINT_LATENCY, "loop_latency_s": LOOP_LATENCY, "release_after_s": RELEASE_AFTER,
               **runs}
    for f in runs.values():
        leave, rate = f["release_to_next_leaves_rotation_s"], f["blob_requests_per_s"]
        print(f"  {f['members']} members, {f['events']} events, hints {f['hints']}: most out at once "
              f"{f['most_out_with_budget']} ({f['places']} places); forced {f['forced']}; approved before NotBefore "
              f"{f['events_approved_before_notbefore']}/{f['events']}; release -> next out of rotation p50 "
              f"{leave['p50']:.2f} s p99 {leave['p99']:.2f} s max {leave['max']:.2f} s; "
              f"{f['store_requests_per_member_per_event']:.1f} store requests per member per event; the blob "
              f"{rate['mean']:.1f} requests/s on average, {rate['busiest_10s']:.1f}/s over the busiest 10 s, "
              f"{rate['busiest_second']:.0f} in the busiest second", flush=True)
    lost = [f for f in runs.values() if f["hints"] == "every one lost"]
    checks = [(f"release -> next member out of rotation, p99, {f['members']} members, every hint lost",
               f"{f['release_to_next_leaves_rotation_s']['p99']:.2f} s", "< 2 s",
               f["release_to_next_leaves_rotation_s"]["p99"] < 2.0) for f in lost]
    checks += [(f"store requests per member per event, {f['members']} members, hints {f['hints']}",
                f"{f['store_requests_per_member_per_event']:.1f}", "<= 10 (issue 30's)",
                f["store_requests_per_member_per_event"] <= 10) for f in runs.values()]
    checks += [(f"requests per second on the group's blob, {f['members']} members, busiest 10 s",
                f"{f['blob_requests_per_s']['busiest_10s']:.1f}", f"< {RATE_TARGET:.0f}",
                f["blob_requests_per_s"]["busiest_10s"] < RATE_TARGET) for f in lost]
    checks += [(f"most members out at once, {f['members']} members, hints {f['hints']}", str(f["most_out_with_budget"]),
                f"<= {f['places']} + forced", f["most_out_with_budget"] <= f["places"] + f["forced"])
               for f in runs.values()]
    return write("budget", figures, checks, quick)
