"""One member of the budget model: the real `Budget` (its loop pass `tick`, `look` with the lease check, the forced
state, the next step, the outcome taken in, `wake`, the approval's checks) run on a frozen copy of its memory.

A model state holds each member's memory as a hashable value (`Memory`); a step thaws it into the member's one
`Budget` object, calls the real method, and freezes what it left. The store is the model's: the `Budget`'s lane is
a recorder, so `tick` hands over the step it would send (`Job`), and the model does the step's read and its
If-Match write as two steps of their own (`budget.step` in two halves, `read_half` and the world's write), then
puts the `Outcome` where the worker would, and calls the loop pass that takes it in.

Freezing keeps what decides something (the place, its lease, the forced events and since when, what is due, the
failures, B7's `out_seen` and `back_since`: whether it was out, and since when it is back in rotation) and drops what
only logs or metrics read (when a wait began, the reasons shown), so two states that differ only in a log line are
one.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from agent.coordination.coordination_settings import BudgetConfig
from agent.coordination.store.store_protocol import StoreError, Unchanged
from agent.fleet.budget import Budget, Outcome, step
from agent.fleet.budget_lease import Mine, Want
from agent.fleet.budget_records import LastRead
from agent.fleet.budget_rules import Me, Places, capacity, parse_places

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
    pending: tuple[bytes, bytes, int, float] | None = None
    """(the record read: its ETag, the body to write, the read's Date, when the read was sent)"""
    hung: tuple[int, float] | None = None
    """A read sent and not answered yet: (the second it was sent in, when on the member's clock)."""


_FIELDS = tuple(f.name for f in fields(Mine))
ERROR = StoreError("unavailable", "the model's store did not answer")
_DROP: dict[str, tuple[Any, Any]] = {"since": (None, 0.0), "waiting_since": (None, 0.0), "reasons": ({}, {"_": "x"}),
                                     "lost_reason": ("", "lost"), "error": (None, ERROR)}
"""Fields only logs, metrics and health read (their value), frozen as set or not: (not set, set)."""


_KINDS = tuple((f.name, 3 if f.name in _DROP else 2 if f.name in ("forced", "known")
                 else 1 if f.type in ("float", "float | None") else 0) for f in fields(Mine))
"""How each field of `Mine` is frozen: 0 as is, 1 a monotonic instant rounded to the microsecond (None kept: e.g.
`back_since`, B7's when it came back into rotation), 2 a mapping as sorted pairs, 3 set or not (`_DROP`)."""


def freeze(m: Mine) -> tuple[Any, ...]:
    d = m.__dict__
    out: list[Any] = []
    for name, kind in _KINDS:
        v = d[name]
        if kind == 0:
            out.append(v)
        elif kind == 1:
            out.append(None if v is None else round(v, 6))
        elif kind == 2:
            out.append(tuple(sorted((k, round(x, 6) if isinstance(x, float) else x) for k, x in v.items())))
        else:
            out.append(None if v is None or v == {} or v == "" else True)
    return tuple(out)


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
    """`Steps` as the loop sees it: the step it sends is taken down (the model does it)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def submit(self, group: str, action: str, me: Me, event: str) -> None:
        self.sent.append((action, event))


class _ModelClock:
    def __init__(self) -> None:
        self.mono, self.wall = 0.0, EPOCH

    def monotonic(self) -> float:
        return self.mono

    def now(self) -> datetime:
        return self.wall


def etag(body: bytes) -> str:
    """The record's ETag: a function of its bytes (the model's store compares bytes for If-Match)."""
    return hashlib.blake2b(body, digest_size=8).hexdigest()


class _Store:
    """The store as one step sees it: the record at store time `t` (a conditional read answers 304 while it is at the
    ETag asked about); the step's write is taken down (`body`) and answered as landed (the model does it as a step
    of its own, its If-Match checked then)."""

    def __init__(self, record: bytes, t: int) -> None:
        self.record, self.t = record, t
        self.body: bytes | None = None

    def read_body(self, name: str) -> tuple[bytes, str, datetime]:
        return self.record, etag(self.record), date(self.t)

    def read_if_changed(self, name: str, tag: str) -> tuple[bytes, str, datetime] | Unchanged:
        return Unchanged(tag, date(self.t)) if tag == etag(self.record) else self.read_body(name)

    def write_body(self, name: str, body: bytes, tag: str | None) -> str | None:
        self.body = body
        return etag(body)


class Member:
    """One member's real `Budget`, driven by the model. `me`: its name and zone; `clock`: its monotonic clock."""

    def __init__(self, me: Me, config: BudgetConfig, clock: Clock, event: str, rejoin_wait: float = 0.0) -> None:
        """`rejoin_wait`: how long it keeps its place once back in rotation (B7: the model's balancer's LB_S)."""
        self.me, self.config, self.clock, self.event = me, config, clock, event
        self._clock = _ModelClock()
        self.budget = Budget(config, store=lambda: None, describe="the model's store",  # type: ignore[arg-type,return-value]
                             clock=self._clock, on_change=lambda: None, health=lambda *a: None,  # type: ignore[arg-type]
                             metrics=_Anything(), needs=lambda: 0.0, lead_time=lambda: 0.0,
                             rejoin_wait=lambda: rejoin_wait)
        self.budget.log = _Anything()  # type: ignore[assignment]
        self.lane = _Lane()
        self.budget.steps = self.lane  # type: ignore[assignment]
        self.budget.identify(me.vm, me.zone, me.fault_domain, GROUP)
        self._written: dict[tuple[str, str, tuple[bytes, bytes, int, float]], Outcome] = {}
        self._passes: dict[tuple[Any, ...], tuple[Memory, Job | None, bool]] = {}
        """Loop passes without an answer to take in, by what they start from (the pass is a function of it)."""

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
        b._stamp.at = float("inf")  # an idle member's stamp (every member_ttl / 3: 20 min) falls past any horizon
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

    def tick(self, memory: Memory, t: float, done: bool, safe: bool, out: bool, started: bool, *,
             outcome: Outcome | None = None, seen: bytes | None = None, woken: bool = False,
             look_first: bool = False) -> tuple[Memory, Job | None, bool]:
        """The loop pass at store time `t`: (its memory after, the step it sent or None, out of rotation after).
        `outcome`: a store step's answer to take in first; `woken`: a wake hint came; `look_first`: the pass
        starts with `look` (resumed from a pause: B2); `started`: out of rotation for its event, still Scheduled;
        `seen`: the record the outcome brings (its bytes)."""
        key = (memory, t, done, safe, out, started, woken, look_first)
        if outcome is None and (known := self._passes.get(key)) is not None:
            return known
        b = self._load(memory, t)
        if outcome is not None:
            b._results.put(outcome)
        if woken:
            b.wake(None)
        wants = self.wants(done, safe, out)
        event = [Want(self.event, "Reboot", EPOCH + (-FAR if safe else FAR))] if started else []
        b._wants, b._started = tuple(wants), tuple(event)
        revoked: frozenset[str] = frozenset()
        if look_first:
            revoked = b.look().revoked
        gate = b.tick(wants, out, event)
        sent = self.lane.sent[0] if self.lane.sent else None
        if done:
            now_out = False
        else:
            now_out = gate.lets(self.event) or (out and self.event not in gate.revoked | revoked)
        keep = memory.seen if outcome is None or outcome.error is not None else seen
        after = self._save(b, keep), Job(*sent) if sent else None, now_out
        if outcome is None:
            self._passes[key] = after
        return after

    def approval(self, memory: Memory, t: float) -> str | None:
        """Why its own event may not be approved now (None: it may): `approval_blocked` and the approver's recheck
        right before the send, `send_blocked` (what it changes in its memory is dropped)."""
        b = self._load(memory, t)
        return b.approval_blocked(self.event, [self.me.vm]) or b.send_blocked(self.event, [self.me.vm])

    def read_half(self, job: Job, record: bytes, t: int, seen: bytes | None = None) -> tuple[Outcome | None, Job]:
        """The real `budget.step` on the record at store time `t`: its `Outcome` when it writes nothing (or the
        record is unreadable), else the job with its write to come (the model does the If-Match write as a step of
        its own; the step's Outcome is kept for it)."""
        sent_at = job.hung[1] if job.hung is not None else self.clock.at(t + LAG)
        store = _Store(record, t)
        try:
            outcome = self._step(job, store, sent_at, seen)
        except StoreError as exc:
            return Outcome(job.action, job.event, error=exc), job
        if store.body is None:
            return outcome, job
        pending = (record, store.body, t, sent_at)
        self._written[(job.action, job.event, pending)] = outcome
        return None, job._replace(pending=pending)

    def written(self, job: Job) -> Outcome:
        """The Outcome of a job whose write landed (the step's own, kept when it read)."""
        assert job.pending is not None
        found = self._written.get((job.action, job.event, job.pending))
        if found is None:  # not kept (another exploration filled the cache): the real step again on the same read
            read, _, t, sent_at = job.pending
            found = self._step(job, _Store(read, t), sent_at, read)
        return found

    def _step(self, job: Job, store: _Store, sent_at: float, seen: bytes | None) -> Outcome:
        """The real step as `Steps._run` calls it; `seen`: the record the lane saw last (its conditional read)."""
        c = self.config
        last = LastRead(seen, etag(seen)) if seen is not None else LastRead()
        return step(store, GROUP, job.action, self.me, job.event,  # type: ignore[arg-type]
                    lambda n: capacity(c.max_unavailable, n), c.spread, c.release_after, lambda: sent_at, last,
                    c.member_ttl)

    @staticmethod
    def failed(job: Job) -> Outcome:
        return Outcome(job.action, job.event, error=ERROR)


def why_of(memory: Memory) -> str | None:
    return memory.mine[_WHY]  # type: ignore[no-any-return]


def field_of(memory: Memory, name: str) -> Any:
    return memory.mine[_FIELDS.index(name)]
