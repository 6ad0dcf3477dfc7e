"""Exactly one VM approves an event, and only once every affected VM is ready.

Rank = position of this VM in the event's Resources; rank 0 leads. Peers are asked
`GET {peer}/v1/events/{EventId}` at most once per poll interval and never twice at a time; `ready`
is final for an event, so a ready peer is not asked again. Requests to one peer go one after
another in that peer's lane (`agent.lanes`), so the threads asking follow the number of peers, not
events × peers. A VM of rank r approves in the leader's place only when every lower-ranked peer has been
unreachable for `takeover_after`. The POST is recorded before (`sending`) and after (`sent` or
`failed`) in the state store: a restart never re-sends a `sent` approval, and a `sending` one
(crash between POST and record) is sent again only if the event is still Scheduled after
RETRY_FAILED_AFTER seconds — time for IMDS to show the first one took effect; a repeat would be
harmless (IMDS answers 200) but is avoided. The loop calls `tick` only right after a successful
poll, so no approval is ever sent on stale data.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import requests
from requests.adapters import HTTPAdapter

from agent import logs
from agent.clock import Clock
from agent.errors import ImdsError
from agent.gates import NO_GATES, GateChecker, Gates, Held
from agent.imds import is_transient
from agent.lanes import Lanes
from agent.metrics import EVENT_TYPES, Metrics
from agent.retry import retrying as retrying_on
from agent.policy import Decision, Profile, decide
from agent.state import Store
from agent.tracker import Tracked

APPROVAL_KEY = "approval"
GATE_NAMES = ("fleet", "prometheus")
RETRY_FAILED_AFTER = 10.0
"""Seconds before an approval whose retries all failed is tried again (the event may still be Scheduled)."""


@dataclass
class PeerState:
    """What this VM knows of one peer for one event."""

    ready: bool = False
    answered: bool = False
    last_ok: float | None = None
    failing_since: float | None = None
    last_asked: float = float("-inf")
    in_flight: bool = False
    detail: str = ""

    def unreachable_for(self, now: float) -> float:
        """Seconds the peer has failed to answer (0 when it answered last time)."""
        return now - self.failing_since if self.failing_since is not None else 0.0


@dataclass
class EventCoordination:
    """Per-event bookkeeping: peers and the last decision."""

    peers: dict[str, PeerState] = field(default_factory=dict)
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
                 warning_as_error: bool = False) -> None:
        self.settings = settings
        self.approve_fn = approve
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.token_reader = token_reader
        self.poll_interval = poll_interval
        self.on_change = on_change
        self.log = logs.get("coordinator")
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._events: dict[str, EventCoordination] = {}
        self._futures: set[concurrent.futures.Future[None]] = set()
        self._peer_lanes = Lanes(settings.max_concurrency, "peer")
        self._approver = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="approve")
        self.session = requests.Session()
        self.session.trust_env = False
        adapter = HTTPAdapter(pool_connections=settings.max_concurrency, pool_maxsize=settings.max_concurrency,
                              max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.gates = gates
        self.warning_as_error = warning_as_error
        self.gate_checker = GateChecker(self.session, self.peer_url, token_reader, local_health,
                                        settings.request_timeout, settings.max_concurrency)

    # --- peers --------------------------------------------------------------------------

    def peer_url(self, name: str) -> str:
        """Base URL of a peer: the static map (case-insensitive) wins over the template."""
        for key, url in self.settings.peers.items():
            if key.casefold() == name.casefold():
                return url.rstrip("/")
        return self.settings.peer_url.format(name=name).rstrip("/")

    def _ask(self, event_id: str, name: str, peer: PeerState) -> None:
        url = f"{self.peer_url(name)}/v1/events/{event_id}"
        token = self.token_reader()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        outcome, ready, detail = "unreachable", False, ""
        try:
            response = self.session.get(url, headers=headers, timeout=self.settings.request_timeout)
            if response.status_code == 200:
                body = response.json()
                ready = bool(body.get("ready")) if isinstance(body, dict) else False
                outcome = "ready" if ready else "not_ready"
                detail = "ready" if ready else "preparing"
            elif response.status_code == 404:
                outcome, detail = "not_ready", "has not seen the event yet"
            else:
                detail = f"answered {response.status_code}"
        except (requests.RequestException, ValueError) as exc:
            detail = type(exc).__name__
        now = self.clock.monotonic()
        self.metrics.peer_requests.labels(outcome).inc()
        with self._lock:
            peer.in_flight = False
            peer.detail = detail
            newly_ready = ready and not peer.ready
            if outcome == "unreachable":
                if peer.failing_since is None:
                    peer.failing_since = now
            else:
                peer.answered, peer.last_ok, peer.failing_since = True, now, None
                peer.ready = peer.ready or ready
        if newly_ready:
            self.on_change()

    def hint(self, event_id: str, name: str) -> bool:
        """A peer says it became ready: ask it again at once (its word is checked, not trusted)."""
        with self._lock:
            state = self._events.get(event_id)
            peer = next((p for n, p in state.peers.items() if n.casefold() == name.casefold()), None) if state else None
            if peer is None or peer.ready:
                return False
            peer.last_asked = float("-inf")
        self.on_change()
        return True

    def tell_leader(self, event_id: str, leader: str, vm_name: str) -> None:
        """Tell the event's leader that this VM is ready, so it need not wait for its next round of asking."""
        def post() -> None:
            token = self.token_reader()
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            try:
                self.session.post(f"{self.peer_url(leader)}/v1/events/{event_id}/peer-ready", json={"vm": vm_name},
                                  headers=headers, timeout=self.settings.request_timeout)
            except requests.RequestException as exc:  # only a hint: the leader asks anyway
                self.log.debug("peer.hint_failed", event_id=event_id, leader=leader, error=type(exc).__name__)

        self._peer_lanes.submit(leader.casefold(), post)

    def _refresh(self, event_id: str, names: list[str], state: EventCoordination) -> None:
        now = self.clock.monotonic()
        for name in names:
            with self._lock:
                peer = state.peers.setdefault(name, PeerState())
                if peer.ready or peer.in_flight or now - peer.last_asked < self.poll_interval:
                    continue
                peer.in_flight, peer.last_asked = True, now
            self._peer_lanes.submit(name.casefold(), functools.partial(self._ask, event_id, name, peer))

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
        """Refresh peers and decide for every Scheduled event naming this VM; send approvals due."""
        now = self.clock.monotonic()
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
            lower = others[:rank]
            if t.event.status == "Scheduled" and mode in ("auto", "immediate") and not self._sent(event_id):
                self._refresh(event_id, others if mode == "auto" else lower, state)
            lower_reachable = [n for n in lower if self._counts_as_present(state, n, now, self.settings.takeover_after)]
            if rank == 0 or not lower_reachable:
                leading[t.event.type_label] = leading.get(t.event.type_label, 0) + 1
            decision = decide(
                mode=mode, status=t.event.status, rank=rank, already_sent=self._sent(event_id),
                manual_requested=self.store.result(event_id, "manual_approval") is not None,
                local_pending=local_pending(t) if mode == "auto" else [],
                peers_not_ready=self._not_ready(state, others[rank:], now),
                lower_ranked_reachable=lower_reachable if mode != "manual" else [],
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

    def _counts_as_present(self, state: EventCoordination, name: str, now: float, after: float) -> bool:
        peer = state.peers.get(name)
        if peer is None or peer.failing_since is None:
            return True
        return peer.unreachable_for(now) < after

    def _not_ready(self, state: EventCoordination, names: list[str], now: float) -> list[str]:
        waiting = []
        for name in names:
            peer = state.peers.get(name)
            if peer is not None and peer.ready:
                continue
            if (self.settings.unreachable_peers == "ignore" and peer is not None
                    and peer.unreachable_for(now) >= self.settings.peer_timeout):
                continue
            waiting.append(name)
        return waiting

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
        if self._gate(event_id, state, gates, resources, vm_name):
            state.sending = False
            return
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
        finally:
            state.sending = False

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
            peers = {n: {"ready": p.ready, "detail": p.detail,
                         "unreachable_seconds": round(p.unreachable_for(now), 1) if p.failing_since is not None else 0}
                     for n, p in list(state.peers.items())[:50]}
        return {
            "approval": approval,
            "approval_mode": state.mode,
            "approval_rule": state.rule,
            "approval_decision": state.decision.reason if state.decision else None,
            "approval_held": {"gate": state.held.gate, "reason": state.held.reason} if state.held else None,
            "peers_ready": sum(1 for p in state.peers.values() if p.ready),
            "peers_known": len(state.peers),
            "peers": peers,
        }

    def stop(self) -> None:
        """Cut retries short and stop the worker pools."""
        self.cancel.set()
        self._peer_lanes.shutdown()
        self._approver.shutdown(wait=False, cancel_futures=True)
