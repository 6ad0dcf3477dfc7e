"""Exactly one VM approves an event, and only once every affected VM is ready — with O(N) requests.

Rank = position of this VM in the event's Resources; rank 0 leads. The rules (who asks whom and
when, takeover, peer timeout) are pure functions in `coordination_rules`; this module applies them,
sends the requests through `peers.PeerClient` (one lane per peer, `agent.lanes`, so the asking
threads follow the number of peers, not events × peers) and keeps the bookkeeping. The acting
leader asks each peer it has not heard ready from, with backoff; a follower that becomes ready
pushes that to the acting leader (retried until taken), which checks it with one ask; a follower
otherwise only watches the lower-ranked peers, to take over once all of them have been unreachable
for `takeover_after`. Peers are addressed through `directory`.

The POST is recorded before (`sending`) and after (`sent` or `failed`) in the state store: a
restart never re-sends a `sent` approval, and a `sending` one (crash between POST and record) is
sent again only if the event is still Scheduled after RETRY_FAILED_AFTER seconds — time for IMDS to
show the first one took effect; a repeat would be harmless (IMDS answers 200) but is avoided. The
loop calls `tick` only right after a successful poll, so no approval is ever sent on stale data.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from agent import logs
from agent.addressing import Address, Identity
from agent.clock import Clock
from agent.coordination_rules import (
    NO_GATES,
    Gates,
    Held,
    PeerState,
    acting_leader,
    failed_since,
    hint_accepted,
    leads_soon,
    liveness_due,
    liveness_interval,
    lower_reachable,
    not_ready,
    push_due,
    readiness_due,
    watch_chain,
)
from agent.directory import SHOWN_PEERS, PeerDirectory
from agent.errors import ImdsError
from agent.gates import GateChecker
from agent.health import HealthStore
from agent.imds import is_transient
from agent.lanes import Lanes
from agent.metrics import EVENT_TYPES, GATE_NAMES, Metrics
from agent.peers import INVALID, UNREACHABLE, Answer, PeerClient
from agent.policy import Decision, Profile, decide
from agent.retry import retrying as retrying_on
from agent.state import Store
from agent.tracker import Tracked

APPROVAL_KEY = "approval"
RETRY_FAILED_AFTER = 10.0
"""Seconds before an approval whose retries all failed is tried again (the event may still be Scheduled)."""


@dataclass
class EventCoordination:
    """Per-event bookkeeping: peers, the last decision, and this VM's readiness push."""

    peers: dict[str, PeerState] = field(default_factory=dict)
    decision: Decision | None = None
    mode: str = ""
    rule: int | None = None
    sending: bool = False
    failed_at: float | None = None
    held: Held | None = None
    leader: str | None = None
    told: str | None = None
    push_to: str | None = None
    push_at: float = float("-inf")
    pushing: bool = False


class Coordinator:
    """Decides and sends approvals; thread-safe views for the API."""

    def __init__(self, settings: Any, *, approve: Callable[[list[str]], None], store: Store, clock: Clock,
                 metrics: Metrics, token_reader: Callable[[], str | None] = lambda: None,
                 poll_interval: float = 1.0, on_change: Callable[[], None] = lambda: None,
                 gates: Gates = NO_GATES, local_health: Callable[[], dict[str, Any]] = lambda: {},
                 warning_as_error: bool = False, health: HealthStore | None = None) -> None:
        self.settings = settings
        self.approve_fn = approve
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.poll_interval = poll_interval
        self.on_change = on_change
        self.directory = PeerDirectory(lambda: self.settings, health)
        self.log = logs.get("coordinator")
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._events: dict[str, EventCoordination] = {}
        self._futures: set[concurrent.futures.Future[None]] = set()
        self._peer_lanes = Lanes(settings.max_concurrency, "peer")
        self._approver = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="approve")
        self.client = PeerClient(token_reader, settings.request_timeout, settings.max_concurrency)
        self.gates = gates
        self.warning_as_error = warning_as_error
        self.gate_checker = GateChecker(self.client, lambda name: self.address(name).url, local_health,
                                        settings.max_concurrency, metrics)

    # --- addressing ---------------------------------------------------------------------

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

    def _refresh_addressing(self) -> None:
        """Follow a reload and the peers file; a fixed address is tried at once, not after the old backoff."""
        self.client.timeout = self.settings.request_timeout
        if self.directory.refresh():
            with self._lock:
                for state in self._events.values():
                    for peer in state.peers.values():
                        peer.hinted = not peer.ready

    # --- peers --------------------------------------------------------------------------

    def _ask(self, event_id: str, name: str, peer: PeerState) -> None:
        address = self.address(name)
        if address.url is None:
            answer = Answer(UNREACHABLE, address.problem)
        else:
            answer = self.client.ask(address.url, event_id)
            self.metrics.peer_requests.labels(answer.outcome).inc()
        now = self.clock.monotonic()
        with self._lock:
            peer.in_flight = False
            changed = peer.detail != answer.detail
            peer.url, peer.via, peer.detail = address.url, address.via, answer.detail
            newly_ready = answer.ready and not peer.ready
            if not answer.reachable:
                peer.failing_since = failed_since(peer, now)
            else:
                peer.last_ok, peer.failing_since = now, None
            peer.ready = peer.ready or answer.ready
            peer.asks = 0 if peer.ready else peer.asks + 1
        if changed and (answer.outcome == INVALID or address.url is None):
            self.log.warning("peer.bad_address" if address.url is None else "peer.invalid_answer",
                             event_id=event_id, peer=name, detail=answer.detail)
        if newly_ready:
            self.on_change()

    def _submit_ask(self, event_id: str, name: str, peer: PeerState, now: float) -> None:
        with self._lock:
            if peer.in_flight:
                return
            peer.in_flight, peer.last_asked, peer.hinted = True, now, False
        self._peer_lanes.submit(name.casefold(), functools.partial(self._ask, event_id, name, peer))

    def hint(self, event_id: str, name: str) -> bool:
        """A peer says it became ready: ask it again at once (its word is checked, not trusted; rate-limited)."""
        now = self.clock.monotonic()
        with self._lock:
            state = self._events.get(event_id)
            peer = (state.peers.get(name) or next((p for n, p in state.peers.items() if n.casefold() == name.casefold()),
                                                  None)) if state else None
            if peer is None or not hint_accepted(peer, now, self.poll_interval):
                return False
            peer.hinted, peer.hint_at = True, now
        self.on_change()
        return True

    def _push(self, event_id: str, state: EventCoordination, leader: str, vm_name: str, now: float) -> None:
        """Tell the acting leader this VM is ready (retried every liveness interval until it takes it)."""
        state.push_to, state.push_at, state.pushing = leader, now, True

        def post() -> None:
            url = self.address(leader).url
            ok = url is not None and self.client.push_ready(url, event_id, vm_name)
            if url is not None:
                self.metrics.peer_requests.labels("pushed" if ok else "push_failed").inc()
            with self._lock:
                state.pushing = False
                state.told = leader if ok else state.told

        self._peer_lanes.submit(leader.casefold(), post)

    def _peer(self, state: EventCoordination, name: str) -> PeerState:
        with self._lock:
            return state.peers.setdefault(name, PeerState())

    def _exchange(self, event_id: str, state: EventCoordination, vm_name: str, lower: list[str],
                  higher: list[str], readiness: bool, locally_ready: bool, now: float) -> None:
        """This tick's requests for one event: watch the leader chain, ask for readiness or push it."""
        every = liveness_interval(self.poll_interval, self.settings.takeover_after)
        for name in watch_chain(lower, state.peers):
            peer = self._peer(state, name)
            if liveness_due(peer, now, every):
                self._submit_ask(event_id, name, peer, now)
        state.leader = acting_leader(lower, state.peers)
        if not readiness:
            return
        if leads_soon(lower, state.peers, now, self.settings.takeover_after):
            for name in higher:
                peer = self._peer(state, name)
                if readiness_due(peer, now, self.poll_interval, self.settings.peer_recheck_max):
                    self._submit_ask(event_id, name, peer, now)
        elif state.leader is not None and locally_ready and not state.pushing \
                and push_due(state.leader, state.told, state.push_to, state.push_at, now, every):
            self._push(event_id, state, state.leader, vm_name, now)

    def _track(self, future: "concurrent.futures.Future[None]") -> None:
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._untrack)

    def _untrack(self, future: "concurrent.futures.Future[None]") -> None:
        with self._lock:
            self._futures.discard(future)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no peer request or approval is under way (tests, benchmarks); `timeout` per kind."""
        if not self._peer_lanes.wait_idle(timeout):
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
        self._refresh_addressing()
        s = self.settings
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
            others = [r for r in t.event.resources if r.casefold() != vm_name.casefold()]
            lower, higher = others[:rank], others[rank:]
            pending = local_pending(t) if mode in ("auto", "manual") else []
            if t.event.status == "Scheduled" and mode in ("auto", "immediate") and not self._sent(event_id):
                self._exchange(event_id, state, vm_name, lower, higher, mode == "auto", not pending, now)
            reachable = lower_reachable(lower, state.peers, now, s.takeover_after)
            if not reachable:
                leading[t.event.type_label] = leading.get(t.event.type_label, 0) + 1
            decision = decide(
                mode=mode, status=t.event.status, rank=rank, already_sent=self._sent(event_id),
                manual_requested=self.store.result(event_id, "manual_approval") is not None,
                local_pending=pending,
                peers_not_ready=not_ready(higher, state.peers, now, s.unreachable_peers, s.peer_timeout),
                lower_ranked_reachable=reachable if mode != "manual" else [],
                dry_run=dry_run)
            self._note(event_id, t, state, decision)
            if decision.approve and not state.sending and state.failed_at is None and self._unconfirmed(event_id):
                state.failed_at = now  # sent by a previous run that died before the answer: give IMDS time
                self.log.warning("approval.unconfirmed", event_id=event_id, wait_seconds=RETRY_FAILED_AFTER,
                                 reason="a previous run sent it and stopped before recording the answer")
            if decision.approve and not state.sending and self._retry_allowed(state, now):
                state.sending = True
                gates = profile.gates if profile.gates is not None else self.gates
                self._track(self._approver.submit(self._send, event_id, vm_name, decision.reason, gates,
                                                  t.event.resources))
            elif not decision.approve:
                state.held = None
        for label in EVENT_TYPES:
            self.metrics.leader.labels(label).set(leading.get(label, 0))
        for gate in GATE_NAMES:
            self.metrics.gate_blocked.labels(gate).set(
                1 if any(s.held and s.held.gate == gate for s in self._events.values()) else 0)

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
              resources: tuple[str, ...] = ()) -> None:
        state = self._events.get(event_id) or EventCoordination()
        try:
            if not self._gate(event_id, state, gates, resources, vm_name):
                self._post(event_id, state, vm_name, reason)
        finally:
            state.sending = False

    def _post(self, event_id: str, state: EventCoordination, vm_name: str, reason: str) -> None:
        try:
            self.store.record(event_id, APPROVAL_KEY, {"status": "sending", "by": vm_name,
                                                       "at": self.clock.now().isoformat(), "reason": reason})
        except Exception as exc:  # a full disk must not stop the approval; it is logged by the store's owner
            self.log.error("state.write_failed", event_id=event_id, key=APPROVAL_KEY, error=str(exc))
        retrying = retrying_on(self.clock, retry_if=is_transient, within=self.settings.approval_retry_for,
                               cancel=self.cancel)
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
        else:
            self.metrics.approvals.labels("sent").inc()
            self.log.info("approval.sent", event_id=event_id, by=vm_name, reason=reason, attempts=attempts)
            self._record(event_id, {"status": "sent", "by": vm_name, "reason": reason, "attempts": attempts,
                                    "at": self.clock.now().isoformat()}, "approval.sent")

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
        now = self.clock.monotonic()
        with self._lock:
            peers = {n: {"ready": p.ready, "detail": p.detail, "url": p.url, "via": p.via,
                         "unreachable_seconds": round(p.unreachable_for(now), 1) if p.failing_since is not None else 0}
                     for n, p in list(state.peers.items())[:SHOWN_PEERS]}
        return {
            "approval": approval,
            "approval_mode": state.mode,
            "approval_rule": state.rule,
            "approval_decision": state.decision.reason if state.decision else None,
            "approval_held": {"gate": state.held.gate, "reason": state.held.reason} if state.held else None,
            "acting_leader": state.leader,
            "readiness_pushed_to": state.told,
            "peers_ready": sum(1 for p in state.peers.values() if p.ready),
            "peers_known": len(state.peers),
            "peers": peers,
        }

    def status(self, tracked: dict[str, Tracked], vm_name: str | None) -> dict[str, Any]:
        """How peers are addressed, for `maintd status`: the sources, and each peer of every pending event."""
        with self._lock:
            known = {event_id: dict(state.peers) for event_id, state in self._events.items()}
        return self.directory.status(tracked, vm_name, known)

    def stop(self) -> None:
        """Cut retries short and stop the worker pools."""
        self.cancel.set()
        self._peer_lanes.shutdown()
        self._approver.shutdown(wait=False, cancel_futures=True)
        self.client.close()
