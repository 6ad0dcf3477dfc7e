"""The disruption budget as a model of the record: members race for places through one record with compare-and-swap,
and a release hands its place to the next in line in the same write. (It models the record, not what each member
believes about it: that, with leases, hints, pauses, partitions and the forced path, is budget_belief.py.)

What each step calls of the real code: `budget_rules.live` and `apply_step` decide every change of the record
(take, force, release, and the handoff `grant` inside every write) on the record as the member read it, at the
store's clock of that read, as `budget.step` does; `render_places` / `parse_places` carry it through the store,
and the store is exact about what matters: a write lands only if the record is still at the ETag the member read
(If-Match). A member's read and its write are separate steps, so every interleaving of reads and writes of all
members is explored; one member may hit its last safe moment (forced) at any time, each may come back into
rotation and release. A waiter the handoff seated is out for everyone else at once, but out of rotation only
once it read the record and took the place (a wake hint or its fallback poll: either is just its next read).
One member may die before it is ever out (it never reads again, never notices a place handed to it); then the
store's clock may pass `release_after`, while the living members renew their entries (as they do every
release_after / 4).

Property B1: never more than `cap` members out by choice (leaving rotation on a `chosen` place, or holding one in
the record), and with `spread: zone` never of two zones, in every reachable state. Property B3: once
`release_after` has passed, no record written after it still holds the dead member (whoever writes frees its
place, and hands it on).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from agent.fleet.budget_rules import (
    CHOSEN,
    FORCE,
    FORCED,
    RELEASE,
    TAKE,
    Me,
    Places,
    apply_step,
    live,
    parse_places,
    render_places,
)

NOW = datetime(2026, 11, 27, 1, 0, tzinfo=UTC)
RELEASE_AFTER = 1800.0
LATE = NOW + timedelta(seconds=RELEASE_AFTER)
MEMBERS = (Me("a", "1"), Me("b", "2"), Me("c", "1"))
FORCEABLE = "c"
"""The member whose last safe moment may come at any time (one is enough to mix forced and chosen places, and
keeps the search small)."""
MORTAL = "b"
"""The member that may die before it is out: queued, perhaps handed a place it never notices."""
IDLE, READ, OUT, BACK, DONE, DEAD = "idle", "read", "out", "back", "done", "dead"


@functools.lru_cache(maxsize=65536)
def _places(record: bytes) -> Places:
    """The record as the real parser reads it (cached: the same bytes recur in many states)."""
    places = parse_places(record)
    assert not isinstance(places, str), places
    return places


class Member(NamedTuple):
    phase: str = IDLE
    seen: bytes | None = None
    why: str = ""
    forced: bool = False


class State(NamedTuple):
    record: bytes
    """The record's body, which is also its ETag here: a record written back to the same bytes matches an
    If-Match on them (a real store would refuse it: the model allows more, so what holds here holds there)."""
    members: tuple[Member, ...]
    late: bytes | None = None
    """The record as it was when the store's clock passed release_after (None: not yet)."""


class BudgetModel:
    """Three members (zones 1, 2, 1), `cap` places, `spread`; `blind` writes without If-Match (a broken
    protocol the checker must catch)."""

    def __init__(self, cap: int = 1, spread: str = "none", blind: bool = False) -> None:
        self.cap, self.spread, self.blind = cap, spread, blind
        self.name = f"budget cap {cap} spread {spread}" + (" (blind writes)" if blind else "")

    def initial(self) -> Iterable[State]:
        yield State(render_places("web", Places()), tuple(Member() for _ in MEMBERS))

    def steps(self, state: State) -> Iterable[tuple[str, State]]:
        for i, (me, m) in enumerate(zip(MEMBERS, state.members, strict=True)):
            if m.phase in (IDLE, BACK):
                yield f"{me.vm} reads the record", self._set(state, i, m._replace(phase=READ, seen=state.record))
            if m.phase == READ and m.seen is not None:
                yield from self._write(state, i, me, m)
            if m.phase in (IDLE, READ) and not m.forced and me.vm == FORCEABLE:
                yield f"{me.vm}'s last safe moment", self._set(state, i, m._replace(forced=True))
            if m.phase in (IDLE, READ) and me.vm == MORTAL:
                yield f"{me.vm} dies (never reads again)", self._set(state, i, m._replace(phase=DEAD))
            if m.phase == OUT:
                yield f"{me.vm} is back in rotation", self._set(state, i, m._replace(phase=BACK))
        if state.late is None and any(m.phase == DEAD for m in state.members):
            record = self._renew_living(state)
            yield "release_after passes (the living renew)", state._replace(record=record, late=record)

    def _write(self, state: State, i: int, me: Me, m: Member) -> Iterable[tuple[str, State]]:
        assert m.seen is not None
        read = _places(m.seen)
        now = NOW if state.late is None else LATE
        places = live(read, now, RELEASE_AFTER)
        action = RELEASE if m.why else FORCE if m.forced else TAKE
        result, _, new = apply_step(places, action, me, f"e-{me.vm}", self.cap, self.spread, now)
        if not self.blind and state.record != m.seen:
            yield f"{me.vm}'s If-Match fails", self._set(state, i, m._replace(phase=BACK if m.why else IDLE))
            return
        record = render_places("web", new) if new != read else state.record
        after = {"acquired": m._replace(phase=OUT, why=CHOSEN), "forced": m._replace(phase=OUT, why=FORCED),
                 "waiting": m._replace(phase=IDLE), "released": m._replace(phase=DONE, why="")}[result]
        yield f"{me.vm} writes: {result}", State(record, self._set(state, i, after).members, state.late)

    def _renew_living(self, state: State) -> bytes:
        """The record with every living member's entry renewed at LATE (their renewals while time passed)."""
        places = _places(state.record)
        dead = {me.vm for me, m in zip(MEMBERS, state.members, strict=True) if m.phase == DEAD}
        holders = tuple(h if h.vm in dead else replace(h, renewed=LATE) for h in places.holders)
        waiting = tuple(w if w.vm in dead else replace(w, renewed=LATE) for w in places.waiting)
        return render_places("web", Places(holders, waiting, places.members))

    @staticmethod
    def _set(state: State, i: int, m: Member) -> State:
        return state._replace(members=state.members[:i] + (m,) + state.members[i + 1:])

    def properties(self) -> Mapping[str, Callable[[State], str | None]]:
        def b1(state: State) -> str | None:
            held = {h.vm for h in _places(state.record).holders if h.why == CHOSEN}
            chosen = [me for me, m in zip(MEMBERS, state.members, strict=True)
                      if (m.phase == OUT and m.why == CHOSEN) or me.vm in held]
            if len(chosen) > self.cap:
                return f"{len(chosen)} out by choice with {self.cap} place(s): {[me.vm for me in chosen]}"
            if self.spread == "zone" and len({me.zone for me in chosen}) > 1:
                return f"out by choice in two zones: {[(me.vm, me.zone) for me in chosen]}"
            return None

        def b3(state: State) -> str | None:
            if state.late is None or state.record == state.late:
                return None
            places = _places(state.record)
            if places.holder(MORTAL) or places.waiter(MORTAL):
                return f"{MORTAL} died before release_after and a record written after it still lists it"
            return None
        return {"B1": b1, "B3": b3}

    def describe(self, state: State) -> str:
        return ", ".join(f"{me.vm}: {m.phase} {m.why}".strip() for me, m in zip(MEMBERS, state.members, strict=True))

    def elapsed(self, label: str) -> float:
        return RELEASE_AFTER if label.startswith("release_after") else 0.0


def granted_unnoticed(state: State) -> bool:
    """A member the handoff seated that has not read the record since (a holder in it, not out)."""
    places = _places(state.record)
    return any(
        places.holder(me.vm) is not None and m.phase in (IDLE, READ, DEAD)
        for me, m in zip(MEMBERS, state.members, strict=True))


def dead_place_taken_over(state: State) -> bool:
    """The dead member held a place when release_after passed, and a living member is out by choice since."""
    return state.late is not None and _places(state.late).holder(MORTAL) is not None and any(
        m.phase == OUT and m.why == CHOSEN for me, m in zip(MEMBERS, state.members, strict=True) if me.vm != MORTAL)
