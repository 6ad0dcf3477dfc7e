"""Parts a test builds with worker threads of their own, stopped when the test ends.

`coord = stopped_at_end(Coordinator(...))` in a test or a helper it calls: the conftest's thread guard calls
every registered `stop()` (last built, first stopped) before it looks for threads the test left running. Only
for a test's own parts: a module or session fixture stops its parts in its own teardown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar


class Stoppable(Protocol):
    def stop(self) -> None: ...


P = TypeVar("P", bound=Stoppable)

_stops: list[Callable[[], None]] = []


def stopped_at_end(part: P) -> P:
    """`part`, whose `stop()` runs when the test ends."""
    _stops.append(part.stop)
    return part


def stop_all() -> list[str]:
    """Stop what the test registered, newest first; what a stop raised, for the guard to report."""
    problems: list[str] = []
    while _stops:
        stop = _stops.pop()
        try:
            stop()
        except Exception as exc:  # one failing stop must not leave the others running
            problems.append(f"{stop!r}: {exc!r}")
    return problems
