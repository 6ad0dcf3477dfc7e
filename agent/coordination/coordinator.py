"""Exactly one VM approves an event, and only once every affected VM is ready — with O(N) requests.

Rank = position of this VM in the event's Resources; rank 0 leads. The rules (who asks whom and
when, takeover, peer timeout) are pure functions in `coordination_rules`; `peer_exchange` sends
each event's peer requests (asks, pushes, the leader-chain watch) as they say. This module decides
from what the peers answered, runs the gates and sends the approval.

The POST (`approver`) is recorded before (`sending`) and after (`sent` or `failed`) in the state
store: a restart never re-sends a `sent` approval, and a `sending` one (crash between POST and
record) is sent again only if the event is still Scheduled after RETRY_FAILED_AFTER seconds — time
for IMDS to show the first one took effect; a repeat would be harmless (IMDS answers 200) but is
avoided. The loop calls `tick` only right after a successful poll, so no approval is ever sent on
stale data.

One owner: the per-event state (`EventCoordination`) is the loop's. The approver hands its outcomes
back through a queue the next tick drains; the peer exchange keeps its own state under its own lock
and hands out copies; the API and peers' hints read `published`, an immutable snapshot the loop
replaces whole at the end of each tick.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from agent import logs
from agent.clock import Clock
from agent.coordination.approval_gates import GateChecker
from agent.coordination.approver import APPROVAL_KEY, Approver, ClaimCheck, Order
from agent.coordination.coordination_rules import (
    Held,
    gate_recheck_delay,
    lower_reachable,
    readiness_missing,
    right_to_post,
    silent_leaders,
    split_ranks,
)
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.peers.peer_addressing import Address
from agent.coordination.peers.peer_directory import SHOWN_PEERS
from agent.coordination.peers.peer_exchange import Exchange, PeerExchange, peer_fleet
from agent.coordination.store.budget import Budget
from agent.coordination.store.store_backend import StoreBackend
from agent.health.health_store import HealthState, HealthStore
from agent.metrics import EVENT_TYPES, GATE_NAMES, Metrics
from agent.model.events import SCHEDULED
from agent.model.gate_specs import NO_GATES, Gates
from agent.model.identity import Identity
from agent.model.tracker import Tracked
from agent.state.state_store import Store
from agent.windows.approval_policy import ALLOWING, AUTO, AWAITING_PREPARATION, MANUAL, Decision, Profile, decide

CLAIMS = ("claim", "take_over")
"""Store backend: the steps that let this VM approve (it claims first)."""
RETRY_FAILED_AFTER = 10.0
"""Seconds before an approval whose retries all failed is tried again (the event may still be Scheduled)."""


@dataclass
class EventCoordination:
    """Per-event bookkeeping, the loop's alone: the peer exchange, the last decision, the gate holding it,
    the POST under way."""

    exchange: Exchange = field(default_factory=Exchange)
    decision: Decision | None = None
    mode: str = ""
    rule: int | None = None
    sending: bool = False
    failed_at: float | None = None
    held: Held | None = None
    gate_due: float = float("-inf")
    """When the gates holding the approval may be asked again (monotonic)."""
    silent: tuple[str, ...] = ()
    """Peer backend: the silent lower-ranked peers that hold this VM's approval as acting leader."""


@dataclass(frozen=True)
class Published:
    """What the API and peers' hints read of one event: the loop's last word, replaced whole each tick."""

    exchange: Exchange
    mode: str
    rule: int | None
    decision: str | None
    held: Held | None


class Coordinator:
    """Decides approvals on the loop's thread and orders them from the approver; views from `published`."""

    def __init__(self, settings: CoordinationConfig, *, approve: Callable[[list[str]], None], store: Store,
                 clock: Clock, metrics: Metrics, token_reader: Callable[[], str | None] = lambda: None,
                 poll_interval: float = 1.0, on_change: Callable[[], None] = lambda: None,
                 gates: Gates = NO_GATES, local_health: Callable[[], dict[str, Any]] = lambda: {},
                 warning_as_error: bool = False, health: HealthStore | None = None,
                 backend: StoreBackend | None = None, budget: Budget | None = None) -> None:
        self.budget = budget
        self.settings, self.store_backend, self.health = settings, backend, health
        self.approve_fn = approve
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.poll_interval = poll_interval
        self.on_change = on_change
        self.log = logs.get("coordinator")
        self.peers = PeerExchange(lambda: self.settings, lambda: self.poll_interval, clock, token_reader=token_reader,
                                  metrics=metrics, on_change=lambda: self.on_change(), health=health)
        self.client, self.directory = self.peers.client, self.peers.directory
        self._events: dict[str, EventCoordination] = {}
        self.published: Mapping[str, Published] = MappingProxyType({})
        self.gates = gates
        self.warning_as_error = warning_as_error
        self.gate_checker = GateChecker(self.client, lambda name: self.address(name).url, local_health,
                                        settings.max_concurrency, metrics, backend.fleet_states if backend else None,
                                        clock.monotonic)
        self.scheduled: frozenset[str] = frozenset()
        """The events Scheduled in this VM's last successful poll (replaced whole by each tick; any thread)."""
        self.approver = Approver(approve=approve, store=store, clock=clock, metrics=metrics,
                                 gate_checker=self.gate_checker, backend=backend, done=lambda: self.on_change(),
                                 right=self.still_right, claim=backend if isinstance(backend, ClaimCheck) else None)

    # --- peers ------------------------------------------------------------------------

    @property
    def identity(self) -> Identity | None:
        """This VM's compute identity (set by the daemon once IMDS told it), for scale-set addressing."""
        return self.directory.identity

    @identity.setter
    def identity(self, value: Identity | None) -> None:
        self.directory.identity = value

    def address(self, name: str) -> Address:
        """Where a peer is asked (see `directory`)."""
        return self.directory.address(name)

    def hint(self, event_id: str, name: str) -> bool:
        """A peer says it became ready: ask it again at once (its word is checked, not trusted; rate-limited)."""
        shown = self.published.get(event_id)
        return shown is not None and self.peers.hint(shown.exchange, name, self.clock.monotonic())

    def wait_idle(self, timeout: float) -> bool:
        """Block until no peer request or approval is under way (tests, benchmarks); `timeout` per kind."""
        if not self.peers.wait_idle(timeout) or (self.store_backend and not self.store_backend.wait_idle(timeout)):
            return False
        return self.approver.wait_idle(timeout)

    # --- decisions ----------------------------------------------------------------------

    def tick(self, tracked: dict[str, Tracked], vm_name: str, profile: Profile, dry_run: bool,
             local_pending: Callable[[Tracked], list[str]]) -> None:
        """Exchange with peers and decide for every Scheduled event naming this VM; send approvals due."""
        now = self.clock.monotonic()
        self.scheduled = frozenset(eid for eid, t in tracked.items() if t.event.status == SCHEDULED)
        self.absorb()
        if self.store_backend is not None:
            self.store_backend.begin()
        else:
            self.peers.refresh([state.exchange for state in self._events.values()])
        leading: dict[str, int] = {}
        for event_id in [e for e in self._events if e not in tracked]:
            if self._events.pop(event_id).silent and self.health is not None:
                self.health.remove("coordination", f"takeover/{event_id}")
        for event_id, t in tracked.items():
            rank = t.event.rank(vm_name)
            if rank is None:
                continue
            state = self._events.setdefault(event_id, EventCoordination())
            state.exchange.follow(t.event.resources)
            mode, rule = profile.approval_for(t.event)
            state.mode, state.rule = mode, rule
            pending = local_pending(t) if mode in AWAITING_PREPARATION or self.store_backend is not None else []
            manual = self.store.result(event_id, "manual_approval") is not None
            sent = self._sent(event_id)
            if self.store_backend is not None:
                waiting, reachable, step = self.store_backend.inputs(event_id, t.event, vm_name, pending, mode, manual,
                                                                     sent)
            else:
                waiting, reachable, step = self._peer_inputs(event_id, state, t, vm_name, mode, pending, sent,
                                                             now)
                if not reachable:
                    leading[t.event.type_label] = leading.get(t.event.type_label, 0) + 1
            decision = decide(
                mode=mode, status=t.event.status, already_sent=sent,
                manual_requested=manual, local_pending=pending, peers_not_ready=waiting,
                lower_ranked_reachable=reachable if mode != MANUAL else [], dry_run=dry_run)
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
            if decision.approve and not state.sending and self._retry_allowed(state, now) and now >= state.gate_due:
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
        if self.store_backend is not None:
            self.store_backend.end(set(self._events))
        self._publish()

    def absorb(self) -> None:
        """Take the approver's outcomes into the loop's state and publish it (each tick starts with this)."""
        outcomes = self.approver.outcomes()
        for outcome in outcomes:
            if (done := self._events.get(outcome.event_id)) is not None:
                done.sending, done.held = False, outcome.held
                if outcome.held is not None:  # asked again at a bounded pace, not on the wake this outcome makes
                    done.gate_due = self.clock.monotonic() + gate_recheck_delay(self.settings.approval_retry_for)
                done.failed_at = outcome.failed_at if outcome.failed_at is not None else done.failed_at
        if outcomes:
            self._publish()

    def _publish(self) -> None:
        self.published = MappingProxyType({
            eid: Published(st.exchange, st.mode, st.rule, st.decision.reason if st.decision else None, st.held)
            for eid, st in self._events.items()})

    def _peer_inputs(self, event_id: str, state: EventCoordination, t: Tracked, vm_name: str, mode: str,
                     pending: list[str], sent: bool, now: float) -> tuple[list[str], list[str], None]:
        """Peer backend: this tick's requests to peers; (peers not ready, lower-ranked peers still present, no step)."""
        s = self.settings
        lower, higher = split_ranks(t.event.resources, vm_name)
        if t.event.status == SCHEDULED and mode in ALLOWING and not sent:
            self.peers.run(event_id, state.exchange, vm_name, lower, higher, mode == AUTO, not pending, now)
        peers = self.peers.peers_now(state.exchange)
        self._silent(event_id, state, tuple(silent_leaders(lower, peers, now, s.takeover_after, s.unreachable_peers,
                                                           s.peer_timeout)))
        return (readiness_missing(lower, higher, peers, now, s.unreachable_peers, s.peer_timeout),
                lower_reachable(lower, peers, now, s.takeover_after), None)

    def _silent(self, event_id: str, state: EventCoordination, silent: tuple[str, ...]) -> None:
        """Say once, in the log and in health (Warning), that this VM leads by the silence of the lower-ranked
        peers and cannot approve early for want of their readiness; take it back when that ends."""
        if silent == state.silent:
            return
        state.silent = silent
        prop = f"takeover/{event_id}"
        if silent:
            self.log.warning("approval.leader_silent", event_id=event_id, peers=list(silent[:5]),
                             outcome="no early approval while they are silent: the event starts at NotBefore")
            if self.health is not None:
                self.health.set("coordination", prop, HealthState.WARNING,
                                f"{', '.join(silent[:5])} silent: this VM leads but cannot approve {event_id} early "
                                "without their readiness (silence is never readiness); the event starts at NotBefore")
        else:
            self.log.info("approval.leader_back", event_id=event_id)
            if self.health is not None:
                self.health.remove("coordination", prop)

    def still_right(self, order: Order) -> str | None:
        """The coordinator's part of the approver's recheck before every send (approver thread): the event is
        still Scheduled in this VM's last poll and, on the peer backend, this VM is still the acting leader with
        every VM ready (the same rule as the decision, on what the peers said since)."""
        if order.event_id not in self.scheduled:
            return "the event is no longer Scheduled in this VM's last poll"
        shown = self.published.get(order.event_id)
        if self.store_backend is not None or order.mode == MANUAL or shown is None:
            return None
        s = self.settings
        lower, higher = split_ranks(order.resources, order.vm_name)
        return right_to_post(lower, higher, self.peers.peers_now(shown.exchange), self.clock.monotonic(),
                             needs_readiness=order.mode == AUTO, takeover_after=s.takeover_after,
                             unreachable_peers=s.unreachable_peers, peer_timeout=s.peer_timeout)

    def _sent(self, event_id: str) -> bool:
        rec = self.store.result(event_id, APPROVAL_KEY)
        return rec is not None and rec.get("status") == "sent"

    def _unconfirmed(self, event_id: str) -> bool:
        rec = self.store.result(event_id, APPROVAL_KEY)
        return rec is not None and rec.get("status") == "sending"

    def _retry_allowed(self, state: EventCoordination, now: float) -> bool:
        return state.failed_at is None or now - state.failed_at >= RETRY_FAILED_AFTER

    def _note(self, event_id: str, t: Tracked, state: EventCoordination, decision: Decision) -> None:
        if state.decision != decision and not decision.approve:
            self.log.info("approval.skipped", event_id=event_id, event_type=t.event.event_type, mode=state.mode,
                          reason=decision.reason)
        state.decision = decision

    # --- views --------------------------------------------------------------------------

    def view(self, event_id: str) -> dict[str, Any]:
        """Coordination fields for /v1/events/{id} and `maintd events` (any thread: the published snapshot)."""
        shown = self.published.get(event_id)
        approval = self.store.result(event_id, APPROVAL_KEY)
        if shown is None:
            return {"approval": approval}
        now = self.clock.monotonic()
        leader, told, known = self.peers.copy_of(shown.exchange)
        return {
            "approval": approval,
            "approval_mode": shown.mode,
            "approval_rule": shown.rule,
            "approval_decision": shown.decision,
            "approval_held": {"gate": shown.held.gate, "reason": shown.held.reason} if shown.held else None,
            "acting_leader": leader,
            "readiness_pushed_to": told,
            "peers_ready": sum(1 for p in known.values() if p.ready),
            "peers_known": len(known),
            "peers": {n: {"ready": p.ready, "detail": p.detail, "url": p.url, "via": p.via,
                          "unreachable_seconds": round(p.unreachable_for(now), 1) if p.failing else 0}
                      for n, p in list(known.items())[:SHOWN_PEERS]},
        }

    def status(self, tracked: Mapping[str, Tracked], vm_name: str | None) -> dict[str, Any]:
        """For `maintd status`: the store and its last answer, or the peers' addresses and answers per event."""
        if self.store_backend is not None:
            return {"coordination": self.store_backend.status()}
        known = {eid: self.peers.copy_of(shown.exchange)[2] for eid, shown in self.published.items()}
        listed = self.directory.status(tracked, vm_name, known)
        return {**listed, "coordination": {"backend": "peers", **listed["coordination"]}}

    def fleet(self, tracked: Mapping[str, Tracked], vm_name: str | None,
              is_ready: Callable[[Tracked], bool]) -> list[dict[str, Any]]:
        """Each pending event naming this VM: its VMs' states, who approved (from the store, or the peers)."""
        if self.store_backend is not None:
            return self.store_backend.fleet()
        published = self.published
        return [peer_fleet(eid, t.event.resources, vm_name or "", is_ready(t),
                           self.peers.copy_of(published[eid].exchange)[2], self.store.result(eid, APPROVAL_KEY))
                for eid, t in tracked.items() if eid in published]

    def stop(self) -> None:
        """Cut retries short and stop the worker pools."""
        self.approver.stop()
        self.peers.stop()
        if self.store_backend is not None:
            self.store_backend.stop()
