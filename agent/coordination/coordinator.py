"""Exactly one VM approves an event, and only once every affected VM is ready — with O(N) requests.

Rank = position of this VM in the event's Resources; rank 0 leads. The coordinator decides, orders
and publishes; what the other VMs said comes from one `Backend` (`agent.coordination.backend`): the
one the config chooses (`backend_registry`: the peers, a blob store, or one a test plugs in), and it knows
none by name. The approver runs the gates and sends the approval.

The POST (`approver`) is recorded before (`sending`) and after (`sent` or `failed`) in the state
store: a restart never re-sends a `sent` approval, and a `sending` one (crash between POST and
record) is sent again only if the event is still Scheduled after RETRY_FAILED_AFTER seconds — time
for IMDS to show the first one took effect; a repeat would be harmless (IMDS answers 200) but is
avoided. The loop calls `tick` right after a successful poll, or when a VM just became ready or
another VM's word came in shortly after one, so no approval is ever sent on stale data. What it decides on
is the loop's `Tick` for that pass (the clock reading, the events, this VM's name and identity, the
profile, each event's pending handlers): it asks neither the clock nor the runner itself.

One owner: the per-event state (`EventCoordination`) is the loop's. The approver hands its outcomes
back through a queue the next tick drains; the backend keeps its own state and publishes its own
snapshot; the API and peers' hints read `published`, an immutable snapshot the loop
replaces whole at the end of each tick.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from agent.clock import Clock
from agent.coordination import backend_registry
from agent.coordination.approval_gates import GateChecker
from agent.coordination.approver import Approver, Order
from agent.coordination.backend import Backend, BackendParts, BackendStatus, CoordinationView, FleetEvent
from agent.coordination.coordination_rules import Held, gate_recheck_delay, unwell
from agent.coordination.coordination_settings import CoordinationConfig
from agent.health.health_json import HealthView
from agent.health.health_store import HealthStore
from agent.loop.tick import Tick
from agent.model.approval import APPROVAL_KEY, MANUAL, MANUAL_APPROVAL_KEY, SENDING, SENT, has_status
from agent.model.events import SCHEDULED
from agent.model.gate_specs import NO_GATES, Gates
from agent.model.identity import Identity
from agent.model.tracker import Tracked
from agent.policy.approval_policy import Decision, decide
from agent.state.state_store import Store
from agent.telemetry import logs
from agent.telemetry.metrics import EVENT_TYPES, GATE_NAMES, Metrics


class ApprovalBudget(Protocol):
    """What the coordinator asks of the disruption budget (`fleet/budget.Budget`): may this event be approved
    early (None), or why not; may it still be sent (the approver's recheck: this VM's own place within its lease,
    any thread); and the group as the API shows it."""

    snapshot: dict[str, Any]

    def approval_blocked(self, event_id: str, resources: Sequence[str]) -> str | None: ...
    def send_blocked(self, event_id: str, resources: Sequence[str]) -> str | None: ...


CLAIMS = ("claim", "take_over")
"""The backend steps that let this VM approve (a backend with steps claims first); any other step holds it."""
RETRY_FAILED_AFTER = 10.0
"""Seconds before an approval whose retries all failed is tried again (the event may still be Scheduled)."""


@dataclass
class EventCoordination:
    """Per-event bookkeeping, the loop's alone: the last decision, the gate holding it, the POST under way."""

    decision: Decision | None = None
    mode: str = ""
    rule: int | None = None
    sending: bool = False
    failed_at: float | None = None
    held: Held | None = None
    gate_due: float = float("-inf")
    """When the gates holding the approval may be asked again (monotonic)."""


@dataclass(frozen=True)
class Published:
    """What the API reads of one event: the loop's last word, replaced whole each tick."""

    mode: str
    rule: int | None
    decision: str | None
    held: Held | None


class Coordinator:
    """Decides approvals on the loop's thread and orders them from the approver; views from `published`."""

    def __init__(self, settings: CoordinationConfig, *, approve: Callable[[list[str]], None], store: Store,
                 clock: Clock, metrics: Metrics, token_reader: Callable[[], str | None] = lambda: None,
                 poll_interval: float = 1.0, on_change: Callable[[], None] = lambda: None,
                 gates: Gates = NO_GATES, local_health: Callable[[], HealthView | None] = lambda: None,
                 warning_as_error: bool = False, health: HealthStore | None = None,
                 backend: Backend | None = None, budget: ApprovalBudget | None = None) -> None:
        """`backend`: the one the wiring built; when none is given, the one `settings.backend` names, built here from
        these parts (`backend_registry`); `budget`: the disruption budget (a backend with a shared store only),
        asked before every early approval."""
        self.settings, self.health, self.budget = settings, health, budget
        self.store = store
        self.metrics = metrics
        self.poll_interval = poll_interval
        self.on_change = on_change
        self.log = logs.get("coordinator")
        self.identity: Identity | None = None
        """This VM's identity as the loop's last pass knew it (the backend reads it through `BackendParts`)."""
        self.backend: Backend = backend or backend_registry.build(BackendParts(
            lambda: self.settings, clock, metrics, health, on_change=lambda: self.on_change(),
            poll_interval=lambda: self.poll_interval, token_reader=token_reader, identity=lambda: self.identity,
            local_health=local_health, warning_as_error=lambda: self.warning_as_error))
        self._events: dict[str, EventCoordination] = {}
        self.published: Mapping[str, Published] = MappingProxyType({})
        self.gates = gates
        self.warning_as_error = warning_as_error
        gate_input = self.backend.gate_input()
        self.gate_checker = GateChecker(gate_input.client, gate_input.health_url, local_health,
                                        settings.max_concurrency, metrics, gate_input.states, clock.monotonic,
                                        lambda: gate_recheck_delay(self.settings.approval_retry_for))
        self.local_health = local_health
        self._own_health: frozenset[tuple[str, str, str]] | None = None
        if health is not None:
            health.subscribe(self._health_changed)
        self.scheduled: frozenset[str] = frozenset()
        """The events Scheduled in this VM's last successful poll (replaced whole by each tick; any thread)."""
        self.approver = Approver(approve=approve, store=store, clock=clock, metrics=metrics,
                                 gate_checker=self.gate_checker, backend=self.backend, done=lambda: self.on_change(),
                                 right=self.still_right)

    # --- other VMs' word -----------------------------------------------------------------

    def hint(self, event_id: str, name: str) -> bool:
        """A peer says it became ready: ask it again at once (its word is checked, not trusted; rate-limited)."""
        return self.backend.hint(event_id, name)

    def health_hint(self, event_id: str, name: str) -> bool:
        """A ready peer says its health changed (any thread): a held fleet gate reads it again (its word is checked,
        not trusted: one read of its /v1/health) and decides at once; False when that was not news."""
        if not self.gate_checker.changed(event_id, name):
            return False
        self.on_change()
        return True

    def _health_changed(self) -> None:
        """A health report was stored or removed (any thread, outside the store's lock): when this VM's own unhealthy
        reports changed, a held fleet gate reads it again and a follower tells its leader, on the pass this wakes."""
        mark = unwell(self.local_health())
        if mark == self._own_health:
            return
        self._own_health = mark
        self.gate_checker.local_changed()
        self.on_change()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no backend request or approval is under way (tests, benchmarks); `timeout` per kind."""
        return self.backend.wait_idle(timeout) and self.approver.wait_idle(timeout)

    # --- decisions ----------------------------------------------------------------------

    def tick(self, tick: Tick) -> None:
        """Ask the backend and decide for every Scheduled event naming this VM; send approvals due (nothing
        while this VM's name is not known)."""
        tracked = tick.tracked
        vm_name = tick.vm_name
        profile = tick.profile
        now = tick.monotonic
        if vm_name is None:
            return
        self.identity = tick.identity
        self.scheduled = frozenset(eid for eid, t in tracked.items() if t.event.status == SCHEDULED)
        self.absorb(now)
        self.backend.begin()
        leading: dict[str, int] = {}
        for event_id in [e for e in self._events if e not in tracked]:
            del self._events[event_id]
        for event_id, t in tracked.items():
            rank = t.event.rank(vm_name)
            if rank is None:
                continue
            state = self._events.setdefault(event_id, EventCoordination())
            mode, rule = profile.approval_for(t.event)
            state.mode = mode
            state.rule = rule
            pending = tick.pending_for(event_id)
            manual = self.store.result(event_id, MANUAL_APPROVAL_KEY) is not None
            sent = self._sent(event_id)
            given = self.backend.inputs(event_id, t.event, vm_name, pending, mode, manual, sent, now)
            if given.leading:
                leading[t.event.type_label] = leading.get(t.event.type_label, 0) + 1
            step = given.step
            decision = decide(
                mode=mode, status=t.event.status, already_sent=sent,
                manual_requested=manual, local_pending=pending, peers_not_ready=given.waiting,
                lower_ranked_reachable=given.reachable if mode != MANUAL else [], dry_run=tick.dry_run)
            if decision.approve and step is not None and step.action not in CLAIMS:
                decision = Decision(False, step.reason)
            if decision.approve and self.budget is not None \
                    and (held := self.budget.approval_blocked(event_id, t.event.resources)) is not None:
                decision = Decision(False, held)
            self._note(event_id, t, state, decision)
            if decision.approve and not state.sending and state.failed_at is None and self._unconfirmed(event_id):
                state.failed_at = now  # sent by a previous run that died before the answer: give IMDS time
                self.log.warning("approval.unconfirmed", event_id=event_id, wait_seconds=RETRY_FAILED_AFTER,
                                 reason="a previous run sent it and stopped before recording the answer")
            if decision.approve and not state.sending and self._retry_allowed(state, now) \
                    and self._gates_due(event_id, state, now):
                state.sending = True
                gates = profile.gates if profile.gates is not None else self.gates
                self.approver.submit(Order(event_id, vm_name, decision.reason, gates, t.event.resources, step,
                                           state.held, self.settings.approval_retry_for, self.warning_as_error,
                                           mode, now + self.settings.takeover_after / 2))
            elif not decision.approve:
                state.held = None
        for label in EVENT_TYPES:
            self.metrics.leader.labels(label).set(leading.get(label, 0))
        for gate in GATE_NAMES:
            self.metrics.gate_blocked.labels(gate).set(
                1 if any(s.held and s.held.gate == gate for s in self._events.values()) else 0)
        self.backend.end(set(self._events))
        self.gate_checker.follow(self._events)
        self._recheck_moved(now)
        self._publish()

    def _gates_due(self, event_id: str, state: EventCoordination, now: float) -> bool:
        """Whether a held approval's gates may be asked now: the periodic recheck is due, or the fleet gate holds it
        and its input changed since (a VM's word, this VM's health, the store's listing). The queries keep their
        pace; the decision does not wait for them."""
        return now >= state.gate_due or (state.held is not None and state.held.gate == "fleet"
                                         and self.gate_checker.moved(event_id))

    def _recheck_moved(self, now: float) -> None:
        """Wake the next pass when the listing the backend just published moved a held fleet gate's input (the
        decision above read the one before)."""
        if any(st.held is not None and st.held.gate == "fleet" and not st.sending and st.decision is not None
               and st.decision.approve and self._retry_allowed(st, now) and now < st.gate_due
               and self.gate_checker.moved(eid) for eid, st in self._events.items()):
            self.on_change()

    def absorb(self, now: float) -> None:
        """Take the approver's outcomes into the loop's state and publish it (each tick starts with this; `now`:
        the pass's monotonic reading)."""
        outcomes = self.approver.outcomes()
        for outcome in outcomes:
            if (done := self._events.get(outcome.event_id)) is not None:
                done.sending = False
                done.held = outcome.held
                if outcome.held is not None:  # asked again at a bounded pace, not on the wake this outcome makes
                    done.gate_due = now + gate_recheck_delay(self.settings.approval_retry_for)
                done.failed_at = outcome.failed_at if outcome.failed_at is not None else done.failed_at
        if outcomes:
            self._publish()

    def _publish(self) -> None:
        self.published = MappingProxyType({
            eid: Published(st.mode, st.rule, st.decision.reason if st.decision else None, st.held)
            for eid, st in self._events.items()})

    def still_right(self, order: Order) -> str | None:
        """The coordinator's part of the approver's recheck before every send (approver thread): the event is
        still Scheduled in this VM's last poll, and under a budget this VM still holds its place (B2: its lease,
        read from the budget's snapshot); the backend's part follows (`Backend.right_to_post`)."""
        if order.event_id not in self.scheduled:
            return "the event is no longer Scheduled in this VM's last poll"
        return None if self.budget is None else self.budget.send_blocked(order.event_id, order.resources)

    def _sent(self, event_id: str) -> bool:
        return has_status(self.store.result(event_id, APPROVAL_KEY), SENT)

    def _unconfirmed(self, event_id: str) -> bool:
        return has_status(self.store.result(event_id, APPROVAL_KEY), SENDING)

    def _retry_allowed(self, state: EventCoordination, now: float) -> bool:
        return state.failed_at is None or now - state.failed_at >= RETRY_FAILED_AFTER

    def _note(self, event_id: str, t: Tracked, state: EventCoordination, decision: Decision) -> None:
        if state.decision != decision and not decision.approve:
            self.log.info("approval.skipped", event_id=event_id, event_type=t.event.event_type, mode=state.mode,
                          reason=decision.reason)
        state.decision = decision

    # --- views --------------------------------------------------------------------------

    def view(self, event_id: str) -> CoordinationView:
        """Coordination fields for /v1/events/{id} and `maintd events` (any thread: the published snapshot)."""
        shown = self.published.get(event_id)
        approval = self.store.result(event_id, APPROVAL_KEY)
        if shown is None:
            return {"approval": approval}
        return {
            "approval": approval,
            "approval_mode": shown.mode,
            "approval_rule": shown.rule,
            "approval_decision": shown.decision,
            "approval_held": {"gate": shown.held.gate, "reason": shown.held.reason} if shown.held else None,
            **self.backend.view(event_id),
        }

    def status(self, tracked: Mapping[str, Tracked], vm_name: str | None) -> BackendStatus:
        """For `maintd status`: the store and its last answer, or the peers' addresses and answers per event."""
        return self.backend.status(tracked, vm_name)

    def fleet(self, tracked: Mapping[str, Tracked], vm_name: str | None,
              is_ready: Callable[[Tracked], bool]) -> list[FleetEvent]:
        """Each pending event naming this VM: its VMs' states, who approved (from the store, or the peers)."""
        return self.backend.fleet(tracked, vm_name, is_ready, lambda eid: self.store.result(eid, APPROVAL_KEY))

    def stop(self) -> None:
        """Cut retries short and stop the worker pools."""
        self.approver.stop()
        self.backend.stop()
