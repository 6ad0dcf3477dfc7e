"""Pure: the order a phase's handlers run in, what each run is told, its budget (its `timeout`, capped in the
`scheduled` phase by the time left before NotBefore minus `DEADLINE_MARGIN`), and how long the phase waits for it.

Handlers run in the list's order (`order`, then their place), with one exception: a type that sets
`before_drain` (the `alertmanager` silence) runs right before the phase's first handler that takes the
VM out of rotation (a type whose `leaves_rotation` names the phase: the `drain`), wherever it is
listed, and its run is told so (`Context.leaving_rotation`): what it makes is in place when the VM
leaves rotation, whatever the order. In a phase without such a handler it runs at its place.

A handler that never holds preparation (`on_failure: continue`) gets a first try of at most
`FIRST_TRY` seconds of the phase's time: a run that has not returned by then goes on in the
background for the rest of its own budget, and the phase goes on with its next handler at once, so
a helper that refuses, hangs or trickles costs the drain and the hooks after it no more than that.
Readiness does not wait for such a run (`run_records.blocks`). A handler that holds (`block`) is
waited for, its whole budget, as ever.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Protocol, TypeVar

from agent.handlers.spec import HandlerSpec
from agent.model.outcomes import PHASE_SCHEDULED

FIRST_TRY = 3.0
"""Seconds a phase waits for a non-holding handler's run before it goes on in the background."""
DEADLINE_MARGIN = 5.0
"""Seconds kept free before NotBefore: a handler budget never reaches into them."""


class Placed(Protocol):
    """What the order reads of a handler: its spec and its type's two flags."""

    @property
    def spec(self) -> HandlerSpec: ...
    @property
    def leaves_rotation(self) -> tuple[str, ...]: ...
    @property
    def before_drain(self) -> bool: ...


H = TypeVar("H", bound=Placed)


def budget(timeout: float, phase: str, not_before: datetime | None, now: datetime) -> float:
    """Seconds a run may take: its timeout, capped before NotBefore in the scheduled phase (≤ 0: too late)."""
    if phase != PHASE_SCHEDULED or not_before is None:
        return timeout
    return min(timeout, (not_before - now).total_seconds() - DEADLINE_MARGIN)


def short_budget(allowed: float, configured: float) -> dict[str, str | float] | None:
    """The `deadline.short` log line's fields when NotBefore cut the run's budget (None: it did not): skipped
    when it cannot start in time, else the budget it runs with."""
    if allowed >= configured:
        return None
    if allowed <= 0:
        return {"action": "skipped", "seconds_left": round(allowed + DEADLINE_MARGIN, 1)}
    return {"action": "budget cut", "timeout": round(allowed, 1), "configured": round(configured, 1)}


def holds(spec: HandlerSpec) -> bool:
    """Whether a run of this handler holds its phase (and readiness) until it ends: anything but `continue`."""
    return spec.on_failure != "continue"


def phase_time(spec: HandlerSpec) -> float:
    """The most of its phase's time a run of the handler takes: its timeout when it holds, else its first try."""
    return spec.timeout if holds(spec) else min(spec.timeout, FIRST_TRY)


def run_order(handlers: Sequence[H], phase: str, runs: Callable[[H], bool] = lambda h: True) -> list[tuple[H, bool]]:
    """The phase's handlers in the order they run, each with whether the VM leaves rotation right after it
    (`leaving_rotation`); `runs` says which will run (dry-run skips: a drain that will not run leaves nothing)."""
    drain = next((i for i, h in enumerate(handlers) if phase in h.leaves_rotation and runs(h)), None)
    if drain is None:
        return [(h, False) for h in handlers]
    ahead = [h for h in handlers if h.before_drain and phase not in h.leaves_rotation]
    rest = [h for h in handlers if h not in ahead]
    at = rest.index(handlers[drain])
    return [(h, False) for h in rest[:at]] + [(h, True) for h in ahead] + [(h, False) for h in rest[at:]]
