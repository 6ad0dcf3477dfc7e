"""Today's budget bugs (issue 34, and B7's that CI found), re-injected into the real code for the checker's self-checks:
a checker that passes on a known-broken version is missing a fault. Each is a context manager that patches the real
functions back to what shipped and restores them on exit (the suite and `python -m bench model` both use them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

from agent.fleet import budget, budget_lease, budget_rules, budget_step
from agent.fleet.budget_rules import RENEW, TAKE


@contextmanager
def renew_reports_renewed() -> Iterator[None]:
    """Finding 2 as it shipped: no lease (a place is held until the member hears otherwise), a RENEW of an entry
    the record no longer lists reports `renewed`, and the member takes that as its place renewed.

    (The RENEW rule alone cannot be seen through the lease: a member's renewal can find its entry gone only after
    its lease ended, since the entry's stamp is the Date of a read it sent within the lease, and by then the lease
    check has given the place up. So the rule is re-injected with the lease it was the only defence of.)"""
    decide = budget_rules._decide

    def old_decide(places: Any, action: Any, me: Any, event: str, *rest: Any) -> tuple[str, str, Any]:
        result = decide(places, action, me, event, *rest)
        return ("renewed", "still out", places) if action == RENEW and result[0] == "lost" else result

    took = budget.Budget._took

    def old_took(self: budget.Budget, o: Any, now: float) -> None:
        if o.result == "renewed" and self.mine.why is not None:  # trusted: "renewed" meant renewed
            self.mine.renew_at = now + self.config.release_after / 4
            return
        took(self, o, now)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(budget_rules, "_decide", old_decide))
        stack.enter_context(mock.patch.object(budget.Budget, "_took", old_took))
        stack.enter_context(mock.patch.object(budget, "lease_end", lambda *a: float("inf")))
        yield


@contextmanager
def force_step_dropped() -> Iterator[None]:
    """Finding 3 as it shipped: a forced member leaves rotation at once, and its forced state is what its events
    waiting for preparation say, so it is cleared once the event no longer waits (the VM is out): the FORCE step
    that had not landed is never sent again, and its own approval waits on its own name."""
    tick = budget.Budget.tick

    def old_tick(self: budget.Budget, wants: Any, out: bool, *rest: Any) -> Any:
        waiting = {w.event_id for w in wants}
        self.mine.forced = {e: t for e, t in self.mine.forced.items() if e in waiting}
        return tick(self, wants, out, *rest)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(budget.Budget, "tick", old_tick))
        stack.enter_context(mock.patch.object(budget_lease, "force_may_leave", lambda *a: True))
        yield


@contextmanager
def granted_without_own_write() -> Iterator[None]:
    """The handoff before B1: a member a release seated takes the place on the releaser's write (a TAKE that finds
    itself granted within renew_after writes nothing), so it leaves rotation with no write of its own. The step's
    confirming write of an unchanged record (`budget_step.confirms`) is taken out too: it would list it again."""
    decide = budget_rules._decide

    def old_decide(places: Any, action: Any, me: Any, event: str, cap: int, spread: str, now: Any,
                   renew_after: float) -> tuple[str, str, Any]:
        held = places.holder(me.vm)
        if action == TAKE and held is not None and held.event == event \
                and (now - held.renewed).total_seconds() < renew_after:
            return "acquired", "a member's release handed it the place", places
        return decide(places, action, me, event, cap, spread, now, renew_after)

    with mock.patch.object(budget_rules, "_decide", old_decide), \
            mock.patch.object(budget_step, "confirms", lambda result: False):
        yield


@contextmanager
def no_head_of_line_reads() -> Iterator[None]:
    """The handoff by hint only (finding 1): no member reads the record more often than its fallback poll, so with
    the hints lost a member a release seated notices only at that poll (at the defaults, 2 minutes later)."""
    def old_poll(config: Any, places: Any, vm: str) -> float:
        return float(min(config.fallback_poll, config.release_after / 4))

    with mock.patch.object(budget, "waiter_poll", old_poll):
        yield


@contextmanager
def release_on_the_first_pass_back() -> Iterator[None]:
    """B7 before it landed (CI's finding: the next member out within one probe round of the holder's 200): a member
    back in rotation releases its place on its first loop pass back, `rejoin_wait` taken as 0, while the load
    balancer still sends it no traffic for LB_S (the model's members are built with `rejoin_wait` = LB_S)."""
    release_due = budget_lease.Mine.release_due

    def old_release_due(self: budget_lease.Mine, rejoin_wait: float) -> float:
        return release_due(self, 0.0)

    with mock.patch.object(budget_lease.Mine, "release_due", old_release_due):
        yield
