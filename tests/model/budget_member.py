"""One member of the budget model: the real `Budget` (its loop pass `tick`, `look` with the lease check, the forced
state, the next step, the outcome taken in, `wake`, the approval's checks) run on a frozen copy of its memory.

A model state holds each member's memory as a hashable value (`Memory`); a step thaws it into the member's one
`Budget` object, calls the real method, and freezes what it left. The store is the model's: the `Budget`'s lane is
a recorder, so `tick` hands over the step it would send (`Job`), and the model does the step's read and its
If-Match write as two steps of their own (`budget.step` in two halves, `read_half` and the world's write), then
puts the `Outcome` where the worker would, and calls the loop pass that takes it in.

Freezing keeps what decides something (the place, its lease, the forced events and since when, what is due, the
failures) and drops what only logs or metrics read (when a wait began, the reasons shown), so two states that
differ only in a log line are one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from agent.coordination.coordination_settings import BudgetConfig
from agent.coordination.store.budget import Budget, Outcome
from agent.coordination.store.budget_lease import Mine, Want
from agent.coordination.store.budget_rules import (
    Me,
    Places,
    apply_step,
    capacity,
    granted,
    live,
    parse_places,
    render_places,
    stale,
)
from agent.coordination.store.store_protocol import StoreError

EPOCH = datetime(2026, 11, 27, 1, 0, tzinfo=UTC)
"""The store's clock at model time 0 (model time counts whole seconds of the store's clock)."""
GROUP = "web"
LAG = 0.999
"""A read is sent this long after the whole second its Date names: the store's Date truncates to the second, so
the worst case for a lease is a read sent just before the Date ticks over (the entry looks a second older than
the member's clock says). The answer is taken in at the same instant (a request takes less than a second)."""
FAR = timedelta(days=1)


def date(t: int) -> datetime:
    return EPOCH + timedelta(seconds=t)


class Clock(NamedTuple):
    """A member's monotonic clock against the store's: `offset + t × (1 + rate)` at store time `t`."""

    offset: float
    rate: float

    def at(self, t: float) -> float:
        return round(self.offset + t * (1.0 + self.rate), 6)


class Memory(NamedTuple):
    """What a member's maintd remembers (frozen `Mine` and the record it last took in)."""

    mine: tuple[Any, ...]
    seen: bytes | None = None


class Job(NamedTuple):
    """A step the loop sent to the store, and where it stands: read (`pending` None) or read, write to come."""

    action: str
    event: str
    pending: tuple[bytes, bytes, str, str, float, int, tuple[str, ...]] | None = None
    """(the ETag read, the body to write, result, reason, sent_at, the read's Date, freed)"""


_FIELDS = tuple(f.name for f in fields(Mine))
ERROR = StoreError("unavailable", "the model's store did not answer")
_DROP: dict[str, tuple[Any, Any]] = {"since": (None, 0.0), "waiting_since": (None, 0.0), "reasons": ({}, {"_": "x"}),
                                     "lost_reason": ("", "lost"), "error": (None, ERROR)}
"""Fields only logs, metrics and health read (their value), frozen as set or not: (not set, set)."""


def _freeze_value(name: str, value: Any) -> Any:
    if name in _DROP:
        return None if value is None or value == {} or value == "" else True
    if isinstance(value, dict):
        return tuple(sorted((k, round(v, 6) if isinstance(v, float) else v) for k, v in value.items()))
    if isinstance(value, float):
        return round(value, 6)
    return value


def freeze(m: Mine) -> tuple[Any, ...]:
    return tuple(_freeze_value(n, getattr(m, n)) for n in _FIELDS)


def thaw(frozen: tuple[Any, ...]) -> Mine:
    m = object.__new__(Mine)
    m.__dict__.update(_thawed(frozen))
    m.forced, m.known, m.reasons = dict(m.forced), dict(m.known), dict(m.reasons)
    return m


@functools.lru_cache(maxsize=100_000)
def _thawed(frozen: tuple[Any, ...]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, value in zip(_FIELDS, frozen, strict=True):
        if name in _DROP:
            values[name] = _DROP[name][1 if value else 0]
        elif name in ("forced", "known"):
            values[name] = dict(value)
        else:
            values[name] = value
    return values


FRESH = freeze(Mine())
_WHY = _FIELDS.index("why")


@functools.lru_cache(maxsize=200_000)
def places_of(body: bytes) -> Places | str:
    """The record as the real parser reads it (cached: the same bytes recur in many states)."""
    return parse_places(body)


class _Anything:
    """Logs and metrics: every attribute and call answers itself (the model reads what is decided, not logged)."""

    def __getattr__(self, name: str) -> _Anything:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _Anything:
        return self


class _Lane:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def submit(self, key: str, job: functools.partial[Any], failed: Any = None) -> None:
        self.sent.append((job.args[1], job.args[3]))  # _run(group, action, me, event)


class _ModelClock:
    def __init__(self) -> None:
        self.mono, self.wall = 0.0, EPOCH

    def monotonic(self) -> float:
        return self.mono

    def now(self) -> datetime:
        return self.wall


class Member:
    """One member's real `Budget`, driven by the model. `me`: its name and zone; `clock`: its monotonic clock."""

    def __init__(self, me: Me, config: BudgetConfig, clock: Clock, event: str) -> None:
        self.me, self.config, self.clock, self.event = me, config, clock, event
        self._clock = _ModelClock()
        self.budget = Budget(config, store=lambda: None, describe="the model's store",  # type: ignore[arg-type,return-value]
                             clock=self._clock, on_change=lambda: None, health=lambda *a: None,  # type: ignore[arg-type]
                             metrics=_Anything(), needs=lambda: 0.0, lead_time=lambda: 0.0)
        self.budget.log = _Anything()  # type: ignore[assignment]
        self.lane = _Lane()
        self.budget._lanes = self.lane  # type: ignore[assignment]
        self.budget.identify(me.vm, me.zone, me.fault_domain, GROUP)

    @staticmethod
    def budget_fresh() -> tuple[Any, ...]:
        """The memory of a maintd just started."""
        return FRESH

    @staticmethod
    def lease(memory: Memory) -> float:
        """Its lease's end on its own clock (-inf: none)."""
        return float(thaw(memory.mine).lease_end)

    def _load(self, memory: Memory, t: float) -> Budget:
        b = self.budget
        b.mine = thaw(memory.mine)
        found = places_of(memory.seen) if memory.seen is not None else None
        b.places = found if isinstance(found, Places) else None
        b.hold = b.mine.hold()
        b._woken.clear()
        self.lane.sent.clear()
        self._clock.mono, self._clock.wall = self.clock.at(t), EPOCH + timedelta(seconds=t)
        return b

    @staticmethod
    def _save(b: Budget, seen: bytes | None) -> Memory:
        return Memory(freeze(b.mine), seen)

    def wants(self, done: bool, safe: bool, out: bool) -> list[Want]:
        """Its event while it waits for its preparation (`preparation.wanting`: held, not over, not out of rotation);
        NotBefore such that its last safe moment has come once `safe`."""
        return [] if done or out else [Want(self.event, "Reboot", EPOCH + (-FAR if safe else FAR))]

    def tick(self, memory: Memory, t: float, done: bool, safe: bool, out: bool, *,
             outcome: Outcome | None = None, seen: bytes | None = None, woken: bool = False,
             look_first: bool = False) -> tuple[Memory, Job | None, bool]:
        """The loop pass at store time `t`: (its memory after, the step it sent or None, out of rotation after).
        `outcome`: a store step's answer to take in first; `woken`: a wake hint came; `look_first`: the pass
        starts with `look` (resumed from a pause: B2); `seen`: the record the outcome brings (its bytes)."""
        b = self._load(memory, t)
        if outcome is not None:
            b._results.put(outcome)
        if woken:
            b.wake(None)
        b._wants = tuple(self.wants(done, safe, out))
        revoked: frozenset[str] = frozenset()
        if look_first:
            revoked = b.look().revoked
        gate = b.tick(self.wants(done, safe, out), out)
        sent = self.lane.sent[0] if self.lane.sent else None
        if done:
            now_out = False
        else:
            now_out = gate.lets(self.event) or (out and self.event not in gate.revoked | revoked)
        keep = memory.seen if outcome is None or outcome.error is not None else seen
        return self._save(b, keep), Job(*sent) if sent else None, now_out

    def approval(self, memory: Memory, t: float) -> str | None:
        """Why its own event may not be approved now (None: it may): `approval_blocked` and the approver's recheck
        right before the send, `send_blocked` (what it changes in its memory is dropped)."""
        b = self._load(memory, t)
        return b.approval_blocked(self.event, [self.me.vm]) or b.send_blocked(self.event, [self.me.vm])

    def read_half(self, job: Job, record: bytes, t: int) -> tuple[Outcome | None, Job]:
        """`budget.step`'s read and decision at store time `t`: an `Outcome` when nothing is to be written (or the
        record is unreadable), else the job with its write to come."""
        sent_at = self.clock.at(t + LAG)
        parsed = places_of(record)
        if isinstance(parsed, str):
            return Outcome(job.action, job.event, error=StoreError("unreadable", parsed)), job
        now = date(t)
        freed = tuple(h.vm for h in stale(parsed, now, self.config.release_after))
        places = live(parsed, now, self.config.release_after)
        cap = capacity(self.config.max_unavailable, len(places.members) or 1)
        result, reason, new = apply_step(places, job.action, self.me, job.event,  # type: ignore[arg-type]
                                         cap, self.config.spread, now, self.config.release_after / 4)
        if new == places and not freed:
            return Outcome(job.action, job.event, result, places, reason, freed=freed, sent_at=sent_at,
                           date=now), job
        return None, job._replace(pending=(record, render_places(GROUP, new), result, reason, sent_at, t, freed))

    def written(self, job: Job) -> Outcome:
        """The Outcome of a job whose write landed."""
        assert job.pending is not None
        read, body, result, reason, sent_at, t, freed = job.pending
        before, after = places_of(read), places_of(body)
        assert isinstance(before, Places) and isinstance(after, Places)
        return Outcome(job.action, job.event, result, after, reason, freed=freed,
                       granted=granted(live(before, date(t), self.config.release_after), after, self.me.vm),
                       sent_at=sent_at, date=date(t))

    @staticmethod
    def failed(job: Job) -> Outcome:
        return Outcome(job.action, job.event, error=ERROR)


def lease_of(memory: Memory) -> float:
    return float(thaw(memory.mine).lease_end)


def why_of(memory: Memory) -> str | None:
    return memory.mine[_WHY]  # type: ignore[no-any-return]


def field_of(memory: Memory, name: str) -> Any:
    return memory.mine[_FIELDS.index(name)]


Factory = Callable[[], Member]
