"""One step of the disruption budget against the store, and the worker lane that runs it (the loop's side is
`budget.Budget`).

A step reads the places record (If-None-Match on the ETag last seen: a 304 costs no body, B4), leaves out its odd
records (B5: counted and reported by `budget_records.RecordProblems`), drops the members that never came back and
the stale member stamps, decides with the pure rules (`budget_rules.apply_step`), refreshes this member's own stamp
once it is a third of `member_ttl` old, and writes the record back with If-Match, again on a conflict. A step that
seats this member (`acquired`) always writes, even a body equal to the record read (B1: out by choice only on a write
of its own; a release that seated it in the same second as its read leaves its entry as the TAKE would write it).
The lane hands an immutable `Outcome` back through a queue the loop drains, and sends the members a write seated a wake
hint (`budget_wake`, an accelerator only).
"""

from __future__ import annotations

import functools
import queue
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from agent.clock import Clock
from agent.coordination.coordination_settings import BudgetConfig
from agent.coordination.store.store_protocol import StoreError
from agent.fleet.budget_records import (
    FUTURE,
    UNREADABLE,
    ConditionalStore,
    LastRead,
    RecordProblems,
    read_record,
    without_odd,
)
from agent.fleet.budget_rules import (
    MEMBER_TTL,
    Action,
    Entry,
    Me,
    Places,
    apply_step,
    capacity,
    granted,
    live,
    parse_places,
    places_blob,
    render_places,
    stale,
    stamped,
)
from agent.fleet.budget_wake import Hinter
from agent.lanes import Lanes

CAS_TRIES = 8
"""Compare-and-swap attempts of one step before it reports a conflict and tries again on the next tick."""


def confirms(result: str) -> bool:
    """Whether a step that came to `result` writes even a body equal to the record it read (If-Match): a seat
    (`acquired`) is confirmed by a write of its own (B1), also when a release seated it in the same second."""
    return result == "acquired"


class BudgetStore(ConditionalStore, Protocol):
    """What the budget needs of `blob_store.BlobStore` (a fake in tests)."""

    def write_body(self, name: str, body: bytes, etag: str | None) -> str | None: ...


@dataclass(frozen=True)
class Outcome:
    """What one store step came to (a worker's hand-back to the loop)."""

    action: str
    event: str
    result: str = ""
    """acquired | forced | waiting | released | renewed | read"""
    places: Places | None = None
    reason: str = ""
    error: StoreError | None = None
    freed: tuple[str, ...] = ()
    granted: tuple[Entry, ...] = ()
    """Members this step's write handed a place (to wake)."""
    sent_at: float = 0.0
    """When the read of the step's last try was sent (monotonic): where its lease starts."""
    date: datetime | None = None
    """The store's Date of that read."""
    odd: tuple[str, ...] = ()
    """The odd records the step's read found and ignored (B5)."""


def step(store: BudgetStore, group: str, action: Action, me: Me, event: str, cap_of: Callable[[int], int],
         spread: str, release_after: float, monotonic: Callable[[], float] = lambda: 0.0,
         last: LastRead | None = None, member_ttl: float = MEMBER_TTL) -> Outcome:
    """One budget step against the store: read, decide (pure), write with If-Match; again on a conflict.
    `monotonic`: this member's clock, read as each read is sent (the outcome's `sent_at`); `last`: the record as
    this member last saw it (each read asks If-None-Match on its ETag: B4); odd records are left out (B5)."""
    name = places_blob(group)
    for _ in range(CAS_TRIES):
        sent_at = monotonic()
        found = read_record(store, name, last)
        if found is None:  # the group's first step: an empty record, read back for the store's clock
            store.write_body(name, render_places(group, Places()), None)
            continue
        parsed = parse_places(found[0])
        if isinstance(parsed, str):
            raise StoreError("unreadable", f"{name}: {parsed}")
        (places, odd), etag, now = without_odd(parsed, found[2]), found[1], found[2]
        freed = tuple(h.vm for h in stale(places, now, release_after))
        places = live(places, now, release_after, member_ttl)
        result, reason, new = apply_step(places, action, me, event, cap_of(len(places.members) or 1), spread, now,
                                         release_after / 4)
        new = stamped(new, me.vm, now, member_ttl)  # B5: counted while it runs, even idle
        if new == places and not freed and not confirms(result):
            return Outcome(action, event, result, places, reason, freed=freed, sent_at=sent_at, date=now, odd=odd)
        body = render_places(group, new)
        if (written := store.write_body(name, body, etag)) is not None:
            if last is not None:
                last.keep(body, written)
            return Outcome(action, event, result, new, reason, freed=freed, granted=granted(places, new, me.vm),
                           sent_at=sent_at, date=now, odd=odd)
    raise StoreError("conflict", f"{name}: rewritten by others {CAS_TRIES} times in a row")


class Steps:
    """The budget's worker side: its steps one after another on one lane, each `Outcome` put in `results`; the
    record last seen (`last`) is the lane's own; thread-safe otherwise."""

    def __init__(self, config: BudgetConfig, open_store: Callable[[], BudgetStore], clock: Clock, metrics: Any,
                 health: Callable[[str, str, str], None], on_change: Callable[[], None],
                 wake_sender: Hinter | None) -> None:
        self.config, self.open_store, self.clock, self.on_change = config, open_store, clock, on_change
        self.wake_sender = wake_sender
        self.results: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self.last = LastRead()
        self.records = RecordProblems(metrics, health, clock.monotonic)
        self._lanes = Lanes(1, "budget")

    def submit(self, group: str, action: Action, me: Me, event: str) -> None:
        self._lanes.submit("budget", functools.partial(self._run, group, action, me, event),
                           functools.partial(self._crashed, action, event))

    def _run(self, group: str, action: Action, me: Me, event: str) -> None:
        c = self.config
        try:
            done = step(self.open_store(), group, action, me, event, lambda n: capacity(c.max_unavailable, n),
                        c.spread, c.release_after, self.clock.monotonic, self.last, c.member_ttl)
            self.records.found(group, FUTURE, done.odd)
        except StoreError as exc:
            done = Outcome(action, event, error=exc)
            if exc.outcome == UNREADABLE:
                self.records.found(group, UNREADABLE, (str(exc),))
        if done.granted and self.wake_sender is not None:
            self.wake_sender.send(group, done.granted)
        self.results.put(done)
        self.on_change()

    def _crashed(self, action: str, event: str, exc: Exception) -> None:
        self.results.put(Outcome(action, event, error=StoreError("internal_error", f"{type(exc).__name__}: {exc}")))
        self.on_change()

    def wait_idle(self, timeout: float) -> bool:
        return self._lanes.wait_idle(timeout) and (self.wake_sender is None or self.wake_sender.wait_idle(timeout))

    def stop(self) -> None:
        self._lanes.shutdown()
        if self.wake_sender is not None:
            self.wake_sender.stop()
