"""The loop's budget and fleet steps in each pass, and what the budget and the fleet history read of this VM.

The daemon calls `FleetPass` in every pass: the budget's lease first (B2: a place whose lease ended is lost before
anything acts on it), the budget's word to preparation (the `LeaveGate`), then the events that ended for this VM to
the fleet history. On the peers backend there is no budget and no history: each step does nothing. The wiring
builds it and hands the budget `preparation_needs` and `lead_seconds`, the history `history_group`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from agent.clock import Clock
from agent.config.config import Config
from agent.handlers.spec import HandlerSpec, Settings
from agent.health.rotation import Rotation
from agent.loop.event_end import EventEnds
from agent.loop.tick import Tick
from agent.model.approval import acts_now
from agent.model.budget_gate import NO_BUDGET, LeaveGate
from agent.model.events import SCHEDULED
from agent.model.identity import Identity
from agent.model.outcomes import PHASE_SCHEDULED
from agent.model.tracker import Tracked
from agent.policy.approval_policy import NOW, LeadTime
from agent.prepare.preparation import Preparation
from agent.prepare.run_order import phase_time
from agent.state.state_store import Store

if TYPE_CHECKING:  # the store backend's parts load only when the config chooses it (decision 0220)
    from agent.fleet.budget import Budget


class FleetPass:
    """This VM's disruption budget and fleet history, stepped by the loop's thread once per pass."""

    def __init__(self, budget: Budget | None, event_ends: EventEnds | None, preparation: Preparation,
                 rotation: Rotation, store: Store, clock: Clock) -> None:
        self.budget = budget
        self.event_ends = event_ends
        self.preparation = preparation
        self.rotation = rotation
        self.store = store
        self.clock = clock

    def look_at_budget(self, tracked: Mapping[str, Tracked]) -> None:
        """B2, first in every loop pass: a place whose lease ended is lost before anything acts on it."""
        if self.budget is not None:
            self.preparation.revoke(self.budget.look(), tracked, self.clock.now())

    def leave_gate(self, tick: Tick) -> LeaveGate:
        """The disruption budget's word to preparation (the loop's thread): which due events may leave rotation.
        This VM is out while drained, or while an event naming it is prepared or Started."""
        if self.budget is None:
            return NO_BUDGET
        from agent.fleet.budget import Want
        wants = [Want(e.event_id, e.event_type, e.not_before) for e in self.preparation.wanting(tick.now)]
        started = [Want(eid, t.event.event_type, t.event.not_before, acts_now(t.event.status, self.store.results(eid)))
                   for eid, t in tick.tracked.items() if t.names_self and self.preparation.started(eid)]
        out = bool(self.rotation.drains() or started) or any(
            t.names_self and t.event.status != SCHEDULED for t in tick.tracked.values())
        gate = self.budget.tick(wants, out, started)
        self.budget.publish()
        return gate

    def record_ended(self, vm_name: str | None) -> None:
        """Each event that ended for this VM goes to the fleet history once (store backend)."""
        if self.event_ends is not None:
            self.event_ends.tick(vm_name)


def preparation_needs(settings: Settings, handlers: Iterable[HandlerSpec]) -> float:
    """What this VM's preparation needs before NotBefore: its drain wait plus its hooks' timeouts (a non-holding
    one's first try only: the rest of its run goes on in the background)."""
    return settings.drain_wait + sum(phase_time(h) for h in handlers
                                     if PHASE_SCHEDULED in h.phases and h.type != "drain")


def lead_seconds(lead: LeadTime) -> float:
    """`prepare.lead_time` in seconds (`now`: none)."""
    return 0.0 if lead == NOW else float(lead)


def rejoin_seconds(config: Config) -> float:
    """B7: how long a member back in rotation keeps its place (`coordination.budget.rejoin_wait`, unset: the
    load balancer's `probe.lb_timeout`)."""
    budget = config.coordination.budget
    wait = budget.rejoin_wait if budget is not None else None
    return config.probe.lb_timeout if wait is None else wait


def history_group(budget: Budget | None, identity: Identity | None) -> str:
    """The fleet history's group: the budget's (`coordination.budget.group`, else its scale set), else this
    VM's scale set (learnt from IMDS), else `_`."""
    from agent.fleet.history_protocol import group_name
    return group_name(budget.group if budget is not None else None,
                      identity.scale_set if identity is not None else None)
