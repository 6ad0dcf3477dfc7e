"""The disruption budget as a model: members race for places through one record with compare-and-swap.

What each step calls of the real code: `budget_rules.apply_step` decides every change of the record (take,
force, release) on the record as the member read it, `render_places` / `parse_places` carry it through the
store, and the store is exact about what matters: a write lands only if the record is still at the ETag the
member read (If-Match), as `budget.step` does. A member's read and its write are separate steps, so every
interleaving of reads and writes of all members is explored; one member may hit its last safe moment
(forced) at any time, and each may come back into rotation and release.

Property B1: never more than `cap` members out by choice (leaving rotation on a `chosen` place), and with
`spread: zone` the members out by choice are never of two zones, in every reachable state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import NamedTuple

from agent.coordination.store.budget_rules import (
    CHOSEN,
    FORCE,
    FORCED,
    RELEASE,
    TAKE,
    Me,
    Places,
    apply_step,
    parse_places,
    render_places,
)

NOW = datetime(2026, 11, 27, 1, 0, tzinfo=UTC)
MEMBERS = (Me("a", "1"), Me("b", "2"), Me("c", "1"))
FORCEABLE = "c"
"""The member whose last safe moment may come at any time (one is enough to mix forced and chosen places, and
keeps the search small)."""
IDLE, READ, OUT, BACK, DONE = "idle", "read", "out", "back", "done"


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
            if m.phase == OUT:
                yield f"{me.vm} is back in rotation", self._set(state, i, m._replace(phase=BACK))

    def _write(self, state: State, i: int, me: Me, m: Member) -> Iterable[tuple[str, State]]:
        assert m.seen is not None
        places = parse_places(m.seen)
        assert not isinstance(places, str)
        action = RELEASE if m.why else FORCE if m.forced else TAKE
        result, _, new = apply_step(places, action, me, f"e-{me.vm}", self.cap, self.spread, NOW)
        if not self.blind and state.record != m.seen:
            yield f"{me.vm}'s If-Match fails", self._set(state, i, m._replace(phase=BACK if m.why else IDLE))
            return
        record = render_places("web", new) if new != places else state.record
        after = {"acquired": m._replace(phase=OUT, why=CHOSEN), "forced": m._replace(phase=OUT, why=FORCED),
                 "waiting": m._replace(phase=IDLE), "released": m._replace(phase=DONE, why="")}[result]
        yield f"{me.vm} writes: {result}", State(record, self._set(state, i, after).members)

    @staticmethod
    def _set(state: State, i: int, m: Member) -> State:
        return state._replace(members=state.members[:i] + (m,) + state.members[i + 1:])

    def properties(self) -> Mapping[str, Callable[[State], str | None]]:
        def b1(state: State) -> str | None:
            chosen = [me for me, m in zip(MEMBERS, state.members, strict=True) if m.phase == OUT and m.why == CHOSEN]
            if len(chosen) > self.cap:
                return f"{len(chosen)} out by choice with {self.cap} place(s): {[me.vm for me in chosen]}"
            if self.spread == "zone" and len({me.zone for me in chosen}) > 1:
                return f"out by choice in two zones: {[(me.vm, me.zone) for me in chosen]}"
            return None
        return {"B1": b1}

    def describe(self, state: State) -> str:
        return ", ".join(f"{me.vm}: {m.phase} {m.why}".strip() for me, m in zip(MEMBERS, state.members, strict=True))

    def elapsed(self, label: str) -> float:
        return 0.0
