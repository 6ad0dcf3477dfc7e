"""This VM's requests to its peers for each event it coordinates: ask for readiness, push its own,
watch the leader chain.

The acting leader asks each peer it has not heard ready from, with backoff; a follower that becomes
ready pushes that to the acting leader (retried until taken), which checks it with one ask; a
follower otherwise only watches the lower-ranked peers, to take over once all of them have been
unreachable for `takeover_after`. The rules are pure functions in `coordination_rules`; this module
applies them and sends the requests through `peers.PeerClient`, one lane per peer (`agent.lanes`),
so the asking threads follow the number of peers, not events × peers. Peers are addressed through
`directory`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from agent.clock import Clock
from agent.coordination.backend import FleetVm
from agent.coordination.coordination_rules import (
    PeerState,
    acting_leader,
    failed_since,
    hint_accepted,
    leads_soon,
    liveness_due,
    liveness_interval,
    push_due,
    readiness_due,
    watch_chain,
)
from agent.coordination.peers.peer_addressing import Address
from agent.coordination.peers.peer_client import INVALID, UNREACHABLE, Answer, PeerClient
from agent.coordination.peers.peer_directory import PeerDirectory
from agent.health.health_store import HealthStore
from agent.lanes import Lanes
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics


class PeerFleetApproval(TypedDict):
    """This VM's approval record as the peers backend's fleet view shows it (read back: any field may be missing)."""

    by: str | None
    state: str | None
    at: str | None


class PeerFleetEvent(TypedDict):
    """One event of `maintd fleet` on the peers backend: each VM as this VM heard it, and its own approval."""

    event_id: str
    source: str
    vms: list[FleetVm]
    approval: PeerFleetApproval | None


@dataclass
class Exchange:
    """One event's peer bookkeeping: what each peer said, the acting leader, and this VM's readiness push."""

    peers: dict[str, PeerState] = field(default_factory=dict)
    leader: str | None = None
    told: str | None = None
    push_to: str | None = None
    push_at: float = float("-inf")
    pushing: bool = False
    health_told: str | None = None
    """This VM's health word the acting leader last took (with its readiness, or since)."""
    resources: tuple[str, ...] = ()
    ranks: dict[str, int] = field(default_factory=dict)

    def follow(self, resources: tuple[str, ...]) -> None:
        """Learn the event's Resources: a peer's answer counts only at its rank there."""
        if resources != self.resources:
            self.resources = resources
            self.ranks = {r.casefold(): i for i, r in reversed(list(enumerate(resources)))}

    def lookup(self, name: str) -> PeerState | None:
        """The peer named `name`, case-insensitively."""
        return self.peers.get(name) or next((p for n, p in self.peers.items() if n.casefold() == name.casefold()),
                                            None)


def peer_fleet(event_id: str, resources: Iterable[str], me: str, me_ready: bool, peers: dict[str, PeerState],
               approval: dict[str, Any] | None) -> PeerFleetEvent:
    """The fleet view of one event on the peer backend: ready, preparing (answered, not ready) or not seen
    (never answered this VM) for each VM named, and this VM's own approval record."""
    def state(name: str) -> str:
        if name.casefold() == me.casefold():
            return "ready" if me_ready else "preparing"
        peer = peers.get(name)
        return "not seen" if peer is None or (peer.last_ok is None and not peer.ready) else \
            "ready" if peer.ready else "preparing"

    shown: PeerFleetApproval | None = None if approval is None else {
        "by": approval.get("by"), "state": approval.get("status"), "at": approval.get("at")}
    return {"event_id": event_id, "source": "peers", "vms": [{"name": n, "state": state(n)} for n in resources],
            "approval": shown}


def _known(ex: Exchange, name: str) -> PeerState:
    """The peer's state, created on first use (the caller holds the lock)."""
    peer = ex.peers.get(name)
    if peer is None:
        peer = ex.peers[name] = PeerState()
    return peer


class PeerExchange:
    """Sends each event's peer requests as the rules say; thread-safe (`lock` guards every `Exchange`)."""

    def __init__(self, settings: Callable[[], Any], poll_interval: Callable[[], float], clock: Clock, *,
                 token_reader: Callable[[], str | None], metrics: Metrics, on_change: Callable[[], None],
                 health: HealthStore | None) -> None:
        s = settings()
        self.settings = settings
        self.clock = clock
        self.poll_interval = poll_interval
        self.metrics = metrics
        self.on_change = on_change
        self.directory = PeerDirectory(settings, health)
        self.client = PeerClient(token_reader, s.request_timeout, s.max_concurrency)
        self.lock = threading.Lock()
        self.log = logs.get("coordinator")
        self._lanes = Lanes(s.max_concurrency, "peer", metrics.lane_errors.labels("peer").inc)

    # --- addressing ---------------------------------------------------------------------

    def address(self, name: str) -> Address:
        """Where a peer is asked (see `directory`)."""
        return self.directory.address(name)

    def refresh(self, exchanges: Iterable[Exchange]) -> None:
        """Follow a reload and the peers file; a fixed address is tried at once, not after the old backoff."""
        self.client.timeout = self.settings().request_timeout
        if self.directory.refresh():
            with self.lock:
                for ex in exchanges:
                    for peer in ex.peers.values():
                        peer.hinted = not peer.ready

    # --- requests -----------------------------------------------------------------------

    def _ask(self, event_id: str, ex: Exchange, name: str, peer: PeerState) -> None:
        address = self.address(name)
        if address.url is None:
            answer = Answer(UNREACHABLE, address.problem)
        else:
            answer = self.client.ask(address.url, event_id, name, ex.ranks.get(name.casefold(), -1))
            self.metrics.peer_requests.labels(answer.outcome).inc()
        now = self.clock.monotonic()
        with self.lock:
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

    def _submit_ask(self, event_id: str, ex: Exchange, name: str, peer: PeerState, now: float) -> None:
        with self.lock:
            if peer.in_flight:
                return
            peer.in_flight, peer.last_asked, peer.hinted = True, now, False
        self._lanes.submit(name.casefold(), functools.partial(self._ask, event_id, ex, name, peer),
                           functools.partial(self._ask_failed, peer))

    def _ask_failed(self, peer: PeerState, exc: Exception) -> None:
        """An ask that raised (the lane logged and counted it): the peer may be asked again, as after silence."""
        with self.lock:
            peer.in_flight = False

    def peers_now(self, ex: Exchange) -> dict[str, PeerState]:
        """The event's peers as a dict of its own (taken under the lock: lanes add peers while the loop
        decides); their fields are read as they are, each read whole."""
        with self.lock:
            return dict(ex.peers)

    def copy_of(self, ex: Exchange) -> tuple[str | None, str | None, dict[str, PeerState]]:
        """The acting leader, who this VM told it is ready, and each peer's state: copies taken under the
        lock, for any thread to read while the lanes go on changing the originals."""
        with self.lock:
            return ex.leader, ex.told, {name: dataclasses.replace(p) for name, p in ex.peers.items()}

    def hint(self, ex: Exchange, name: str, now: float) -> bool:
        """A peer says it became ready: ask it again at once (its word is checked, not trusted; rate-limited)."""
        with self.lock:
            peer = ex.lookup(name)
            if peer is None or not hint_accepted(peer, now, self.poll_interval()):
                return False
            peer.hinted, peer.hint_at = True, now
        self.on_change()
        return True

    def _push(self, event_id: str, ex: Exchange, leader: str, vm_name: str, now: float, health: str | None,
              readiness: bool = True) -> None:
        """Tell the acting leader this VM is ready (retried every liveness interval until it takes it), or, once it
        took that, that this VM's health changed (`readiness` False: retried on the next pass until taken)."""
        if readiness:
            ex.push_to, ex.push_at = leader, now
        ex.pushing = True

        def post() -> None:
            url = self.address(leader).url
            ok = url is not None and self.client.push_ready(url, event_id, vm_name, None if readiness else health)
            if url is not None:
                self.metrics.peer_requests.labels("pushed" if ok else "push_failed").inc()
            with self.lock:
                ex.pushing = False
                if ok:
                    ex.told, ex.health_told = (leader if readiness else ex.told), health

        def failed(exc: Exception) -> None:
            with self.lock:
                ex.pushing = False

        self._lanes.submit(leader.casefold(), post, failed)

    def _peer(self, ex: Exchange, name: str) -> PeerState:
        with self.lock:
            return _known(ex, name)

    def _readiness_due(self, ex: Exchange, higher: list[str], now: float) -> list[tuple[str, PeerState]]:
        """The peers the acting leader asks now: one pass under the lock (a leader of 1000 VMs runs it per tick)."""
        poll, recheck_max = self.poll_interval(), self.settings().peer_recheck_max
        with self.lock:
            return [(name, peer) for name, peer in ((n, _known(ex, n)) for n in higher)
                    if readiness_due(peer, now, poll, recheck_max)]

    def run(self, event_id: str, ex: Exchange, vm_name: str, lower: list[str], higher: list[str],
            readiness: bool, locally_ready: bool, now: float, health: str | None = None) -> None:
        """This tick's requests for one event: watch the leader chain, ask for readiness or push it (and, once the
        acting leader took it, this VM's `health` word each time it changes: its fleet gate reads it again)."""
        s = self.settings()
        every = liveness_interval(self.poll_interval(), s.takeover_after)
        for name in watch_chain(lower, ex.peers):
            peer = self._peer(ex, name)
            if liveness_due(peer, now, every):
                self._submit_ask(event_id, ex, name, peer, now)
        ex.leader = acting_leader(lower, ex.peers)
        if not readiness:
            return
        if leads_soon(lower, ex.peers, now, s.takeover_after):
            for name, peer in self._readiness_due(ex, higher, now):
                self._submit_ask(event_id, ex, name, peer, now)
        elif ex.leader is not None and locally_ready and not ex.pushing:
            if push_due(ex.leader, ex.told, ex.push_to, ex.push_at, now, every):
                self._push(event_id, ex, ex.leader, vm_name, now, health)
            elif ex.told == ex.leader and health != ex.health_told and health is not None:
                self._push(event_id, ex, ex.leader, vm_name, now, health, readiness=False)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no peer request is under way (tests, benchmarks)."""
        return self._lanes.wait_idle(timeout)

    def stop(self) -> None:
        self._lanes.shutdown()
        self.client.close()
