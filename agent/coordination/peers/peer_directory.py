"""Where each peer is, as configured right now: the static map, the peers file, the template and this VM's identity.

The coordinator asks `address(name)` before each request and calls `refresh()` once per tick, which
takes the last look of the `peers_file` watcher (`PeersWatch`, on a thread of its own: the tick
never stats nor reads the file; its first look is made when the directory is built, at start, so the
first tick already has the file's map); a bad file keeps the last good map, logged and reported in health
until it is fixed. `status()` is what `maintd status` shows: the sources and, for each peer of a
pending event, the URL it is asked at and how that was decided.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypedDict

from agent.coordination.coordination_rules import PeerState
from agent.coordination.coordination_settings import CoordinationConfig
from agent.coordination.member_urls import unusable_computer_name
from agent.coordination.peers.peer_addressing import Address, folded, resolve
from agent.coordination.peers.peers_file import PeersWatch
from agent.health.health_store import HealthState, HealthStore
from agent.model.events import SCHEDULED
from agent.model.identity import Identity
from agent.model.tracker import Tracked
from agent.telemetry import logs

SHOWN_PEERS = 50
"""Peers listed per event in views (counts cover all of them)."""


class IdentityView(TypedDict):
    """This VM's identity as the peer directory knows it."""

    name: str
    computer_name: str
    scale_set: str


class PeerSources(TypedDict):
    """Where the peers' addresses come from, in `maintd status` (`coordination`)."""

    peer_url: str
    peers_static: int
    peers_file: str | None
    peers_file_entries: int
    peers_file_problem: str | None
    identity: IdentityView | None


class PeersStatus(TypedDict):
    """The peer directory's part of `maintd status`: the sources, and per pending event each peer's line."""

    coordination: PeerSources
    peers: dict[str, dict[str, str]]


class PeerDirectory:
    """Peer addresses from the settings in force (replaced on reload) and the peers file."""

    def __init__(self, settings: Callable[[], CoordinationConfig], health: HealthStore | None) -> None:
        self.settings = settings
        self.health = health
        self.log = logs.get("coordinator")
        self._identity: Identity | None = None
        self._watch = PeersWatch(settings().peers_file)
        self._seen = 0  # the version of the watcher's look in force
        self._file_peers: dict[str, str] = {}
        self._static: tuple[dict[str, str], dict[str, str]] = ({}, {})

    @property
    def identity(self) -> Identity | None:
        """This VM's compute identity, once IMDS told it (scale-set peers' computer names derive from it)."""
        return self._identity

    @identity.setter
    def identity(self, me: Identity | None) -> None:
        if me is not None and unusable_computer_name(me) and me != self._identity:
            self.log.warning("identity.computer_name_unusable", computer_name=me.computer_name[:80],
                             scale_set=me.scale_set[:80],
                             detail="not {prefix}{6 base-36 digits}: scale-set peers' computer names are not derived; "
                                    "list them in coordination.peers_file")
        self._identity = me

    def address(self, name: str) -> Address:
        """Where a peer is asked: `peers`, then `peers_file`, then the `peer_url` template."""
        s = self.settings()
        if s.peers is not self._static[0]:
            self._static = (s.peers, folded(s.peers))
        return resolve(name, peers=self._static[1], peers_file=self._file_peers, template=s.peer_url, me=self.identity)

    def refresh(self) -> bool:
        """Follow a reload of the settings and a change of the peers file; True when a new good map is in force."""
        path = self.settings().peers_file
        if self._watch.path != path:  # a reload: the last map stays in force until the new file's first look
            self._watch.stop()
            self._watch, self._seen = PeersWatch(path, look_now=False), 0
            if path is None:
                self._file_peers = {}
        latest = self._watch.latest
        if latest.version == self._seen:
            return False
        self._seen = latest.version
        self._file_peers = folded(latest.peers)
        problem = latest.problem
        if problem:
            self.log.warning("peers_file.invalid", problem=problem, kept_entries=len(self._file_peers))
            if self.health:
                self.health.set("coordination", "peers_file", HealthState.WARNING,
                                f"{problem}; using the last good map ({len(self._file_peers)} peers)")
            return False
        self.log.info("peers_file.loaded", path=self._watch.path, entries=len(self._file_peers))
        if self.health:
            self.health.remove("coordination", "peers_file")
        return True

    def status(self, tracked: Mapping[str, Tracked], vm_name: str | None,
               known: Mapping[str, Mapping[str, PeerState]]) -> PeersStatus:
        """For `maintd status`: the sources, and each peer of every pending event naming this VM (URL, how, answer)."""
        events: dict[str, dict[str, str]] = {}
        for event_id, t in list(tracked.items()):
            if t.event.status != SCHEDULED or vm_name is None or t.event.rank(vm_name) is None:
                continue
            peers = known.get(event_id, {})
            names = [r for r in t.event.resources if r.casefold() != vm_name.casefold()]
            events[event_id] = {name: self._row(name, peers.get(name)) for name in names[:SHOWN_PEERS]}
        return {"coordination": self._sources(), "peers": events}

    def _row(self, name: str, peer: PeerState | None) -> str:
        address = self.address(name)
        answer = ("ready" if peer.ready else peer.detail or "asked") if peer else "not asked by this VM"
        return f"{address.url or address.problem} (via {address.via}): {answer}"

    def _sources(self) -> PeerSources:
        s, me = self.settings(), self.identity
        return {
            "peer_url": s.peer_url,
            "peers_static": len(s.peers),
            "peers_file": self._watch.path,
            "peers_file_entries": len(self._file_peers),
            "peers_file_problem": self._watch.latest.problem,
            "identity": {"name": me.name, "computer_name": me.computer_name, "scale_set": me.scale_set} if me else None,
        }
