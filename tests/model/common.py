"""What the peer and store models share: abstract time, the fault budget, IMDS as the VMs see it, the
two safety properties, and the approval POST's retry discipline (the real `agent.retry.retrying`).

Time moves in ticks of `takeover_after / 2` (`TICK`). A state holds no clock, only ages: how many
ticks ago something happened, clamped at `CAP` ticks (no time limit of the default configuration that
decides anything here is longer: takeover_after is 2 ticks, the POST's retries 2, the store's POST
deadline 1; peer_timeout, 4, counts only with `unreachable_peers: ignore`), so the search
covers time without end and two situations that differ only in how long ago something happened,
beyond every limit, are one state. The real functions are handed absolute seconds: "now" is `CAP`
ticks, and something `age` ticks old happened at (CAP - age) × TICK. What takes less than a tick
(a request, a retry's backoff of at most 5.5 s, a poll each second) happens between two ticks, in
any order with everything else; each running VM's loop runs at least once in every tick. A paused
VM takes no step while the others go on, and its monotonic clock runs on (the time it was paused
counts, as CLOCK_MONOTONIC does under SIGSTOP). A frozen VM (the store model's `FREEZE`) takes no step either,
and its monotonic clock stands still while the store's time runs (a suspend stops CLOCK_MONOTONIC, and a guest
frozen by the hypervisor may resume with its monotonic clock not advanced by the whole freeze): the ages it holds
do not grow.

A fault is spent from a budget: each kind at most once per path, `MAX_FAULTS` in all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple

from agent.coordination.approver import Approver, Order
from agent.coordination.coordination_settings import CoordinationConfig
from agent.model.events import SCHEDULED, STARTED
from agent.model.gate_specs import NO_GATES
from agent.retry import retrying

SETTINGS = CoordinationConfig()
"""The default configuration: the guarantees are stated for it."""
TAKEOVER = SETTINGS.takeover_after
TICK = TAKEOVER / 2
CAP = 2
"""Ages stop counting at this many ticks (takeover_after): no limit compared with them is longer."""
NOW = CAP * TICK
"""The time the real functions are told it is, in seconds."""
TIME_PASSES = f"{TICK:.0f}s pass"
MAX_FAULTS = 1
"""Faults per path: one of any kind (two multiply the states by about twenty; see docs/PERFORMANCE.md)."""
VMS = ("vm-a", "vm-b", "vm-c")
"""Resources of the event in rank order: vm-a leads."""
EVENT_ID = "6b1f0c2e-8d1a-4b7e-9c55-0d2f6a9e3b11"
UP, PAUSED, FROZEN, DOWN = "up", "paused", "frozen", "down"
CRASH, PAUSE, LOST_ANSWER, LOST_MESSAGE, ODD_RECORD, RESTART, POST_ERROR, WEDGE, FREEZE = (
    "crash", "pause", "lost answer", "lost message", "odd record", "restart", "IMDS 500", "wedge", "uncounted pause")


def at(age: int | None) -> float | None:
    """When something `age` ticks old happened, in seconds (None stays None)."""
    return None if age is None else (CAP - age) * TICK


def age_of(secs: float) -> int:
    """The age in ticks of something that happened at `secs`."""
    return CAP - round(secs / TICK)


def older(age: int | None) -> int | None:
    """An age one tick later."""
    return None if age is None else min(CAP, age + 1)


class Imds(NamedTuple):
    """The event at IMDS: its status, which VMs' POSTs landed, and the first POST sent too early (S1)."""

    status: str = SCHEDULED
    posted_by: frozenset[str] = frozenset()
    early: str | None = None


def post_lands(imds: Imds, vm: str, prepared: dict[str, bool]) -> Imds:
    """A POST from `vm` reaches IMDS; it is early (S1) when a VM named had not become ready."""
    waiting = [n for n in VMS if not prepared[n]]
    early = imds.early or (f"{vm} POSTed while {', '.join(waiting)} had not said it is ready" if waiting else None)
    return imds._replace(posted_by=imds.posted_by | {vm}, early=early)


def post_outcomes(imds: Imds, vm: str, prepared: dict[str, bool],
                  spend_one: Callable[[str], tuple[str, ...] | None]) -> list[tuple[str, Imds, tuple[str, ...] | None]]:
    """What one send of `vm`'s POST may come to: (what happened, IMDS after, the faults spent or None when it
    succeeded): a 200; with the budget, a lost answer (it landed) or an IMDS 500 (it did not)."""
    landed = post_lands(imds, vm, prepared)
    out: list[tuple[str, Imds, tuple[str, ...] | None]] = [("200", landed, None)]
    for kind, after, what in ((LOST_ANSWER, landed, "it landed, the answer is lost"),
                              (POST_ERROR, imds, "IMDS answers 500")):
        if (faults := spend_one(kind)) is not None:
            out.append((f"FAULT {what}", after, faults))
    return out


def imds_steps(imds: Imds) -> list[tuple[str, Imds]]:
    """IMDS starts the event a moment after a POST landed (before the next tick: it takes seconds)."""
    if imds.status == SCHEDULED and imds.posted_by:
        return [("IMDS starts the event (StartRequests took effect)", imds._replace(status=STARTED))]
    return []


def s1(imds: Imds) -> str | None:
    """S1: no POST while any VM named has not positively said it is ready."""
    return imds.early


def s2(imds: Imds) -> str | None:
    """S2: at most one VM POSTs for the event (a retry of one VM's own POST is the same approval)."""
    if len(imds.posted_by) > 1:
        return f"{len(imds.posted_by)} VMs POSTed: {', '.join(sorted(imds.posted_by))}"
    return None


def spend(faults: tuple[str, ...], kind: str, budget: int = MAX_FAULTS) -> tuple[str, ...] | None:
    """The faults after one more of `kind`, or None when the budget is spent (or that kind already happened)."""
    if kind in faults or len(faults) >= budget:
        return None
    return tuple(sorted(faults + (kind,)))


class ModelClock:
    """The clock the real code reads: the model's time in seconds."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


def _failed(attempt: int) -> SimpleNamespace:
    """tenacity's state after failed attempt number `attempt`."""
    error = RuntimeError("IMDS did not answer")
    return SimpleNamespace(attempt_number=attempt, outcome=SimpleNamespace(exception=lambda: error))


def _retrying(started: int, within: float) -> tuple[ModelClock, Any]:
    clock = ModelClock(at(started) or 0.0)
    r = retrying(clock, retry_if=lambda exc: True, within=within)  # type: ignore[arg-type]
    clock.now = NOW
    return clock, r


@functools.cache
def retry_stops(started: int, within: float, attempt: int) -> bool:
    """Whether the real approval retry (`agent.retry.retrying`) gives up after failed attempt number `attempt`,
    begun `started` ticks ago, allowed `within` seconds."""
    return bool(_retrying(started, within)[1].stop(_failed(attempt)))


@functools.cache
def retry_refuses(started: int, within: float, attempt: int) -> bool:
    """Whether the real approval retry refuses to start attempt number `attempt` now (its check right before
    each attempt after the first), begun `started` ticks ago, allowed `within` seconds."""
    _, r = _retrying(started, within)
    r.stop(_failed(attempt - 1))
    try:
        r.before(SimpleNamespace(attempt_number=attempt, outcome=None))
    except RuntimeError:
        return True
    return False


def order(vm: str, mode: str, decided: int, step: Any = None) -> Order:
    """The approver's order as the coordinator's tick makes it, `decided` ticks ago (its deadline: half of
    takeover_after after the decision)."""
    return Order(EVENT_ID, vm, "every affected VM is ready", NO_GATES, VMS, step, None, SETTINGS.approval_retry_for,
                 False, mode, (at(decided) or 0.0) + TAKEOVER / 2)


def lapsed(o: Order, started: int, within: float, right: Callable[[Order], str | None],
           backend: Any) -> str | None:
    """The real approver's recheck right before a send (`Approver.lapsed`): the order's deadline and the POST's
    own (`within` from `started` ticks ago), the coordinator's part (`right`) and the backend's
    (`Backend.right_to_post`: the peers' rule, or the store's claim check)."""
    approver = SimpleNamespace(clock=ModelClock(), right=right, backend=backend)
    return Approver.lapsed(approver, o, min(o.deadline, (at(started) or 0.0) + within))  # type: ignore[arg-type]
