"""The peers backend as the coordinator sees it (`agent.coordination.backend.Backend`): each event's
exchange with its peers, the decision's inputs from what they answered, the acting leader's silence
warning, the right to post rechecked before every send, and the views.

One owner: `_events` is the loop's; the peer exchange keeps the peers' states under its own lock and
hands out copies; other threads read `published`, replaced whole at the end of each tick.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

from agent.clock import Clock
from agent.coordination.backend import (
    BackendParts,
    BackendStatus,
    Carrier,
    EventView,
    FleetEvent,
    GateInput,
    Inputs,
    Right,
)
from agent.coordination.coordination_rules import (
    health_word,
    lower_reachable,
    readiness_missing,
    right_to_post,
    silent_leaders,
    split_ranks,
)
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.peers.peer_directory import SHOWN_PEERS
from agent.coordination.peers.peer_exchange import Exchange, PeerExchange, peer_fleet
from agent.health.health_json import HealthView
from agent.health.health_store import HealthState, HealthStore
from agent.model.approval import ALLOWING, AUTO, AWAITING_PREPARATION, MANUAL
from agent.model.events import SCHEDULED, Event
from agent.model.identity import Identity
from agent.model.tracker import Tracked
from agent.telemetry import logs


@dataclass
class EventPeers:
    """One event's exchange with its peers and the silent lower-ranked peers holding this VM as acting leader."""

    exchange: Exchange = field(default_factory=Exchange)
    silent: tuple[str, ...] = ()


def build(parts: BackendParts) -> PeerBackend:
    """The peers backend for `coordination.backend: peers` (`backend_registry`): its exchange (addressing, the
    HTTP client, the lanes), on the settings in force."""
    settings = cast(Callable[[], CoordinationConfig], parts.settings)
    exchange = PeerExchange(settings, parts.poll_interval, parts.clock, token_reader=parts.token_reader,
                            metrics=parts.metrics, on_change=parts.on_change, health=parts.health)
    return PeerBackend(exchange, settings, parts.clock, parts.health, parts.identity)


class PeerBackend:
    """Coordination through the peers: O(N) requests per event, the leader chain, readiness pushes."""

    def __init__(self, peers: PeerExchange, settings: Callable[[], CoordinationConfig], clock: Clock,
                 health: HealthStore | None, identity: Callable[[], Identity | None] = lambda: None) -> None:
        self.peers, self.settings, self.clock, self.health = peers, settings, clock, health
        self.identity = identity
        """This VM's identity (Uniform scale-set computer names are derived from it), read at each tick's start."""
        self.log = logs.get("coordinator")
        self._events: dict[str, EventPeers] = {}
        self._health: HealthView | None = None
        """This VM's health as of this tick's start (what a ready follower tells its leader when it changes)."""
        self.published: Mapping[str, Exchange] = MappingProxyType({})

    # --- the loop ------------------------------------------------------------------------------

    def begin(self) -> None:
        self.peers.directory.identity = self.identity()
        self.peers.refresh([state.exchange for state in self._events.values()])
        self._health = self.health.to_json() if self.health is not None else None

    def inputs(self, event_id: str, event: Event, vm_name: str, pending: Sequence[str], mode: str, manual: bool,
               sent: bool, now: float) -> Inputs:
        """This tick's requests to peers; (peers not ready, lower-ranked peers still present, no step)."""
        state = self._events.setdefault(event_id, EventPeers())
        state.exchange.follow(event.resources)
        s = self.settings()
        lower, higher = split_ranks(event.resources, vm_name)
        if event.status == SCHEDULED and mode in ALLOWING and not sent:
            ready = not pending or mode not in AWAITING_PREPARATION
            word = health_word(self._health, event_id) if self._health is not None else None
            self.peers.run(event_id, state.exchange, vm_name, lower, higher, mode == AUTO, ready, now, word)
        peers = self.peers.peers_now(state.exchange)
        self._silent(event_id, state, tuple(silent_leaders(lower, peers, now, s.takeover_after, s.unreachable_peers,
                                                           s.peer_timeout)))
        reachable = lower_reachable(lower, peers, now, s.takeover_after)
        return Inputs(readiness_missing(lower, higher, peers, now, s.unreachable_peers, s.peer_timeout), reachable,
                      None, leading=not reachable)

    def end(self, events: set[str]) -> None:
        for event_id in [e for e in self._events if e not in events]:
            if self._events.pop(event_id).silent and self.health is not None:
                self.health.remove("coordination", f"takeover/{event_id}")
        self.published = MappingProxyType({eid: st.exchange for eid, st in self._events.items()})

    def _silent(self, event_id: str, state: EventPeers, silent: tuple[str, ...]) -> None:
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

    # --- the approver --------------------------------------------------------------------------

    def right_to_post(self, event_id: str, resources: tuple[str, ...], vm_name: str, mode: str,
                      step: object) -> str | None:
        """This VM is still the acting leader with every VM ready (the decision's rule, on what the peers said
        since); a manual approval needs no peer."""
        exchange = self.published.get(event_id)
        if mode == MANUAL or exchange is None:
            return None
        s = self.settings()
        lower, higher = split_ranks(resources, vm_name)
        return right_to_post(lower, higher, self.peers.peers_now(exchange), self.clock.monotonic(),
                             needs_readiness=mode == AUTO, takeover_after=s.takeover_after,
                             unreachable_peers=s.unreachable_peers, peer_timeout=s.peer_timeout)

    def take_right(self, event_id: str, vm_name: str, step: object, retry_for: float) -> Right:
        """The right to post as the decision granted it (no claim on the peers: `right_to_post` rechecks it)."""
        return Right(retry_for)

    def settle(self, event_id: str, vm_name: str, right: Right, sent: bool | None) -> None:
        """Nothing to give back on the peers."""

    def gate_input(self) -> GateInput:
        """The fleet gate asks each peer's /v1/health, at its address, with the peers' client (and token)."""
        return GateInput(self.peers.client, lambda name: self.peers.address(name).url)

    def carrier(self) -> Carrier | None:
        """No shared store: no disruption budget, no fleet history on this backend."""
        return None

    # --- views ---------------------------------------------------------------------------------

    def hint(self, event_id: str, name: str) -> bool:
        exchange = self.published.get(event_id)
        return exchange is not None and self.peers.hint(exchange, name, self.clock.monotonic())

    def view(self, event_id: str) -> EventView:
        exchange = self.published.get(event_id)
        leader, told, known = self.peers.copy_of(exchange) if exchange is not None else (None, None, {})
        now = self.clock.monotonic()
        return {
            "acting_leader": leader,
            "readiness_pushed_to": told,
            "peers_ready": sum(1 for p in known.values() if p.ready),
            "peers_known": len(known),
            "peers": {n: {"ready": p.ready, "detail": p.detail, "url": p.url, "via": p.via,
                          "unreachable_seconds": round(p.unreachable_for(now), 1) if p.failing else 0}
                      for n, p in list(known.items())[:SHOWN_PEERS]},
        }

    def status(self, tracked: Mapping[str, Tracked], vm_name: str | None) -> BackendStatus:
        known = {eid: self.peers.copy_of(exchange)[2] for eid, exchange in self.published.items()}
        listed = self.peers.directory.status(tracked, vm_name, known)
        return {**listed, "coordination": {"backend": "peers", **listed["coordination"]}}

    def fleet(self, tracked: Mapping[str, Tracked], vm_name: str | None, is_ready: Callable[[Tracked], bool],
              approval: Callable[[str], dict[str, Any] | None]) -> list[FleetEvent]:
        published = self.published
        return [peer_fleet(eid, t.event.resources, vm_name or "", is_ready(t), self.peers.copy_of(published[eid])[2],
                           approval(eid))
                for eid, t in tracked.items() if eid in published]

    def wait_idle(self, timeout: float) -> bool:
        return self.peers.wait_idle(timeout)

    def stop(self) -> None:
        self.peers.stop()
