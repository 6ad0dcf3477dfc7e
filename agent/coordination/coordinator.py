"""Exactly one VM approves an event, and only once every affected VM is ready — with O(N) requests.

Rank = position of this VM in the event's Resources; rank 0 leads. The rules (who asks whom and
when, takeover, peer timeout) are pure functions in `coordination_rules`; `peer_exchange` sends
each event's peer requests (asks, pushes, the leader-chain watch) as they say. This module decides
from what the peers answered, runs the gates and sends the approval.

The POST is recorded before (`sending`) and after (`sent` or `failed`) in the state store: a
restart never re-sends a `sent` approval, and a `sending` one (crash between POST and record) is
sent again only if the event is still Scheduled after RETRY_FAILED_AFTER seconds — time for IMDS to
show the first one took effect; a repeat would be harmless (IMDS answers 200) but is avoided. The
loop calls `tick` only right after a successful poll, so no approval is ever sent on stale data.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from agent import logs
from agent.coordination.peer_addressing import Address
from agent.model.identity import Identity
from agent.clock import Clock
from agent.coordination.coordination_rules import NO_GATES, Gates, Held, lower_reachable, not_ready
from agent.coordination.peer_directory import SHOWN_PEERS
from agent.errors import ImdsError
from agent.coordination.approval_gates import GateChecker
from agent.health.health_store import HealthStore
from agent.imds.imds_client import is_transient
from agent.metrics import EVENT_TYPES, GATE_NAMES, Metrics
from agent.coordination.peer_exchange import Exchange, PeerExchange, peer_fleet
from agent.coordination.store_backend import StoreBackend
from agent.coordination.store_protocol import Step
from agent.windows.approval_policy import Decision, Profile, decide
from agent.retry import retrying as retrying_on
from agent.state.state_store import Store
from agent.model.tracker import Tracked

APPROVAL_KEY = "approval"
CLAIMS = ("claim", "take_over")
"""Store backend: the steps that let this VM approve (it claims first)."""
RETRY_FAILED_AFTER = 10.0
"""Seconds before an approval whose retries all failed is tried again (the event may still be Scheduled)."""


@dataclass
class EventCoordination:
    """Per-event bookkeeping: the peer exchange, the last decision, the gate holding it, the POST under way."""

    exchange: Exchange = field(default_factory=Exchange)
    decision: Decision | None = None
    mode: str = ""
    rule: int | None = None
    sending: bool = False
    failed_at: float | None = None
    held: Held | None = None


class Coordinator:
    """Decides and sends approvals; thread-safe views for the API."""

    def __init__(self, settings: Any, *, approve: Callable[[list[str]], None], store: Store, clock: Clock,
                 metrics: Metrics, token_reader: Callable[[], str | None] = lambda: None,
                 poll_interval: float = 1.0, on_change: Callable[[], None] = lambda: None,
                 gates: Gates = NO_GATES, local_health: Callable[[], dict[str, Any]] = lambda: {},
                 warning_as_error: bool = False, health: HealthStore | None = None,
                 backend: StoreBackend | None = None) -> None:
        self.settings, self.store_backend = settings, backend
        self.approve_fn = approve
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.poll_interval = poll_interval
        self.on_change = on_change
        self.log = logs.get("coordinator")
        self.cancel = threading.Event()
        self.peers = PeerExchange(lambda: self.settings, lambda: self.poll_interval, clock, token_reader=token_reader,
                                  metrics=metrics, on_change=lambda: self.on_change(), health=health)
        self.client, self.directory, self._lock = self.peers.client, self.peers.directory, self.peers.lock
        self._events: dict[str, EventCoordination] = {}
        self._futures: set[concurrent.futures.Future[None]] = set()
        self._approver = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="approve")
        self.gates = gates
        self.warning_as_error = warning_as_error
        self.gate_checker = GateChecker(self.client, lambda name: self.address(name).url, local_health,
                                        settings.max_concurrency, metrics, backend.fleet_states if backend else None)

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
        state = self._events.get(event_id)
        return state is not None and self.peers.hint(state.exchange, name, self.clock.monotonic())

    def _track(self, future: "concurrent.futures.Future[None]") -> None:
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._untrack)

    def _untrack(self, future: "concurrent.futures.Future[None]") -> None:
        with self._lock:
            self._futures.discard(future)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no peer request or approval is under way (tests, benchmarks); `timeout` per kind."""
        if not self.peers.wait_idle(timeout) or (self.store_backend and not self.store_backend.wait_idle(timeout)):
            return False
        with self._lock:
            pending = set(self._futures)
        done, not_done = concurrent.futures.wait(pending, timeout=timeout)
        return not not_done

    # --- decisions ----------------------------------------------------------------------

    def tick(self, tracked: dict[str, Tracked], vm_name: str, profile: Profile, dry_run: bool,
             local_pending: Callable[[Tracked], list[str]]) -> None:
        """Exchange with peers and decide for every Scheduled event naming this VM; send approvals due."""
        now = self.clock.monotonic()
        if self.store_backend is not None:
            self.store_backend.begin()
        else:
            self.peers.refresh([state.exchange for state in self._events.values()])
        leading: dict[str, int] = {}
        for event_id in [e for e in self._events if e not in tracked]:
            del self._events[event_id]
        for event_id, t in tracked.items():
            rank = t.event.rank(vm_name)
            if rank is None:
                continue
            state = self._events.setdefault(event_id, EventCoordination())
            mode, rule = profile.approval_for(t.event)
            state.mode, state.rule = mode, rule
            pending = local_pending(t) if mode in ("auto", "manual") or self.store_backend is not None else []
            manual = self.store.result(event_id, "manual_approval") is not None
            if self.store_backend is not None:
                waiting, reachable, step = self.store_backend.inputs(
                    event_id, t.event, vm_name, pending, mode, manual, self._sent(event_id))
            else:
                waiting, reachable, step = self._peer_inputs(event_id, state, t, vm_name, rank, mode, pending, now)
                if not reachable:
                    leading[t.event.type_label] = leading.get(t.event.type_label, 0) + 1
            decision = decide(
                mode=mode, status=t.event.status, rank=rank, already_sent=self._sent(event_id),
                manual_requested=manual, local_pending=pending, peers_not_ready=waiting,
                lower_ranked_reachable=reachable if mode != "manual" else [], dry_run=dry_run)
            if decision.approve and step is not None and step.action not in CLAIMS:
                decision = Decision(False, step.reason)
            self._note(event_id, t, state, decision)
            if decision.approve and not state.sending and state.failed_at is None and self._unconfirmed(event_id):
                state.failed_at = now  # sent by a previous run that died before the answer: give IMDS time
                self.log.warning("approval.unconfirmed", event_id=event_id, wait_seconds=RETRY_FAILED_AFTER,
                                 reason="a previous run sent it and stopped before recording the answer")
            if decision.approve and not state.sending and self._retry_allowed(state, now):
                state.sending = True
                gates = profile.gates if profile.gates is not None else self.gates
                self._track(self._approver.submit(self._send, event_id, vm_name, decision.reason, gates,
                                                  t.event.resources, step))
            elif not decision.approve:
                state.held = None
        for label in EVENT_TYPES:
            self.metrics.leader.labels(label).set(leading.get(label, 0))
        for gate in GATE_NAMES:
            self.metrics.gate_blocked.labels(gate).set(
                1 if any(s.held and s.held.gate == gate for s in self._events.values()) else 0)
        if self.store_backend is not None:
            self.store_backend.end(set(self._events))

    def _peer_inputs(self, event_id: str, state: EventCoordination, t: Tracked, vm_name: str, rank: int, mode: str,
                     pending: list[str], now: float) -> tuple[list[str], list[str], None]:
        """Peer backend: this tick's requests to peers; (peers not ready, lower-ranked peers still present, no step)."""
        s = self.settings
        others = [r for r in t.event.resources if r.casefold() != vm_name.casefold()]
        lower, higher = others[:rank], others[rank:]
        if t.event.status == "Scheduled" and mode in ("auto", "immediate") and not self._sent(event_id):
            self.peers.run(event_id, state.exchange, vm_name, lower, higher, mode == "auto", not pending, now)
        peers = state.exchange.peers
        return (not_ready(higher, peers, now, s.unreachable_peers, s.peer_timeout),
                lower_reachable(lower, peers, now, s.takeover_after), None)

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

    # --- sending ------------------------------------------------------------------------

    def _gate(self, event_id: str, state: EventCoordination, gates: Gates, resources: tuple[str, ...],
              vm_name: str) -> bool:
        """True when a gate holds the approval (logged when the reason changes)."""
        held = self.gate_checker.check(gates, event_id, resources, vm_name, self.warning_as_error) if gates.active else None
        if held is not None and held != state.held:
            self.log.warning("approval.held", event_id=event_id, gate=held.gate, reason=held.reason)
            self.store.journal("approval.held", event_id=event_id, gate=held.gate, reason=held.reason)
        elif held is None and state.held is not None:
            self.log.info("approval.gate_open", event_id=event_id, gate=state.held.gate)
        state.held = held
        return held is not None

    def _send(self, event_id: str, vm_name: str, reason: str, gates: Gates = NO_GATES,
              resources: tuple[str, ...] = (), step: Step | None = None) -> None:
        state = self._events.get(event_id) or EventCoordination()
        try:
            if self._gate(event_id, state, gates, resources, vm_name):
                return
            if step is None:
                self._post(event_id, state, vm_name, reason, self.settings.approval_retry_for)
            elif self.store_backend is not None:
                self.store_backend.claim_and_post(event_id, vm_name, step, self.settings.approval_retry_for,
                                                  lambda within: self._post(event_id, state, vm_name, reason, within))
        finally:
            state.sending = False

    def _post(self, event_id: str, state: EventCoordination, vm_name: str, reason: str, within: float) -> bool:
        try:
            self.store.record(event_id, APPROVAL_KEY, {"status": "sending", "by": vm_name,
                                                       "at": self.clock.now().isoformat(), "reason": reason})
        except Exception as exc:  # a full disk must not stop the approval; it is logged by the store's owner
            self.log.error("state.write_failed", event_id=event_id, key=APPROVAL_KEY, error=str(exc))
        retrying = retrying_on(self.clock, retry_if=is_transient, within=within, cancel=self.cancel)
        attempts = 0

        def post() -> None:
            nonlocal attempts
            attempts += 1
            self.approve_fn([event_id])

        try:
            retrying(post)
        except ImdsError as exc:
            self.metrics.approvals.labels("failed").inc()
            self.log.error("approval.failed", event_id=event_id, error=str(exc), code=exc.code, attempts=attempts,
                           body=exc.body[:200] or None)
            self._record(event_id, {"status": "failed", "by": vm_name, "error": str(exc), "attempts": attempts,
                                    "at": self.clock.now().isoformat()}, "approval.failed")
            state.failed_at = self.clock.monotonic()
            return False
        else:
            self.metrics.approvals.labels("sent").inc()
            self.log.info("approval.sent", event_id=event_id, by=vm_name, reason=reason, attempts=attempts)
            self._record(event_id, {"status": "sent", "by": vm_name, "reason": reason, "attempts": attempts,
                                    "at": self.clock.now().isoformat()}, "approval.sent")
            return True

    def _record(self, event_id: str, value: dict[str, Any], journal: str) -> None:
        try:
            self.store.record(event_id, APPROVAL_KEY, value, journal=journal)
        except Exception as exc:
            self.log.error("state.write_failed", event_id=event_id, key=APPROVAL_KEY, error=str(exc))

    # --- views --------------------------------------------------------------------------

    def view(self, event_id: str) -> dict[str, Any]:
        """Coordination fields for /v1/events/{id} and `maintd events`."""
        state = self._events.get(event_id)
        approval = self.store.result(event_id, APPROVAL_KEY)
        if state is None:
            return {"approval": approval}
        now, ex = self.clock.monotonic(), state.exchange
        with self._lock:
            peers = {n: {"ready": p.ready, "detail": p.detail, "url": p.url, "via": p.via,
                         "unreachable_seconds": round(p.unreachable_for(now), 1) if p.failing_since is not None else 0}
                     for n, p in list(ex.peers.items())[:SHOWN_PEERS]}
        return {
            "approval": approval,
            "approval_mode": state.mode,
            "approval_rule": state.rule,
            "approval_decision": state.decision.reason if state.decision else None,
            "approval_held": {"gate": state.held.gate, "reason": state.held.reason} if state.held else None,
            "acting_leader": ex.leader,
            "readiness_pushed_to": ex.told,
            "peers_ready": sum(1 for p in ex.peers.values() if p.ready),
            "peers_known": len(ex.peers),
            "peers": peers,
        }

    def status(self, tracked: dict[str, Tracked], vm_name: str | None) -> dict[str, Any]:
        """For `maintd status`: the store and its last answer, or the peers' addresses and answers per event."""
        if self.store_backend is not None:
            return {"coordination": self.store_backend.status()}
        with self._lock:
            known = {event_id: dict(state.exchange.peers) for event_id, state in self._events.items()}
        shown = self.directory.status(tracked, vm_name, known)
        return {**shown, "coordination": {"backend": "peers", **shown["coordination"]}}

    def fleet(self, tracked: dict[str, Tracked], vm_name: str | None,
              is_ready: Callable[[Tracked], bool]) -> list[dict[str, Any]]:
        """Each pending event naming this VM: its VMs' states, who approved (from the store, or the peers)."""
        if self.store_backend is not None:
            return self.store_backend.fleet()
        with self._lock:
            return [peer_fleet(event_id, t.event.resources, vm_name or "", is_ready(t),
                               dict(self._events[event_id].exchange.peers), self.store.result(event_id, APPROVAL_KEY))
                    for event_id, t in tracked.items() if event_id in self._events]

    def stop(self) -> None:
        """Cut retries short and stop the worker pools."""
        self.cancel.set()
        self.peers.stop()
        if self.store_backend is not None:
            self.store_backend.stop()
        self._approver.shutdown(wait=False, cancel_futures=True)
