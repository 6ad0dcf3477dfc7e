"""The one interface the coordinator has to a coordination backend: the peers (`coordination/peers/`)
or a blob store (`coordination/store/`); a new backend, or the fleet's disruption budget, plugs in here.

The coordinator decides, orders and publishes; it knows no backend by name. Per tick, on the loop's
thread: `begin`, then `inputs` for each event naming this VM (what the decision needs: who is not
ready, who ranks before this VM and is still there, the backend's step), then `end` with the events
still followed. On the approver thread, right before every send: `right_to_post`; the send itself
goes through `send` (the store claims around it). Views (any thread): `hint`, `view`, `status`,
`fleet`, and `gate_states` for the fleet gate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict

from agent.coordination.peers.peer_directory import PeerSources
from agent.model.approval import ApprovalView
from agent.model.events import Event
from agent.model.tracker import Tracked

if TYPE_CHECKING:
    from agent.coordination.store.store_protocol import Step

FleetStates = Callable[[str, Sequence[str], str, bool], dict[str, str]]
"""(event id, Resources, this VM, warning as error) -> each VM's ok / unhealthy / unreachable: asked of the
peers' /v1/health, or (backend azure_blob) read from their markers in the store."""


@dataclass(frozen=True)
class Inputs:
    """What a backend tells the decision about one event, this tick."""

    waiting: list[str]
    """The other VMs not (yet) known ready."""
    reachable: list[str]
    """The VMs ranked before this one that are still there (this VM is not the leader while any is)."""
    step: Step | None = None
    """The backend's protocol step (the store: wait, claim, take over, done); None: no step of its own."""
    leading: bool = False
    """This VM acts as the event's leader (the `maintd_coordination_leader` gauge)."""


class PeerView(TypedDict):
    """One peer as /v1/events/{id} shows it."""

    ready: bool
    detail: str
    url: str | None
    via: str
    unreachable_seconds: float


class EventView(TypedDict):
    """A backend's fields of /v1/events/{id}: the peers' exchange (empty on a backend that asks no peer)."""

    acting_leader: str | None
    readiness_pushed_to: str | None
    peers_ready: int
    peers_known: int
    peers: dict[str, PeerView]


class CoordinationView(ApprovalView):
    """The coordination fields of /v1/events/{id} and `maintd events` (`Coordinator.view`): the approval's, then
    the backend's (`EventView`), both only once the coordinator has decided for the event."""

    acting_leader: NotRequired[str | None]
    readiness_pushed_to: NotRequired[str | None]
    peers_ready: NotRequired[int]
    peers_known: NotRequired[int]
    peers: NotRequired[dict[str, PeerView]]


class PeersCoordination(PeerSources):
    """`maintd status`'s `coordination` on the peers backend: its name and where the peers' addresses come from."""

    backend: str


class StoreCoordination(TypedDict):
    """`maintd status`'s `coordination` on the store backend: the store, its last answer and how long ago."""

    backend: str
    store: str
    store_last_answer: str
    store_last_answer_seconds_ago: float | None


class BackendStatus(TypedDict):
    """A backend's part of `maintd status`; the peers backend adds each pending event's peers (name: its line)."""

    coordination: PeersCoordination | StoreCoordination
    peers: NotRequired[dict[str, dict[str, str]]]


class FleetVm(TypedDict):
    """One VM an event names, as `maintd fleet` shows it."""

    name: str
    state: str


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


class StoreFleetApproval(TypedDict):
    """Who approved (or claimed) an event, as the store last said."""

    by: str
    state: str
    attempt: int
    at: str | None


class StoreFleetEvent(TypedDict):
    """One event of `maintd fleet` on the store backend: each VM's marker, the approval, what the store got wrong."""

    event_id: str
    source: str
    vms: list[FleetVm]
    approval: StoreFleetApproval | None
    store_error: str | None
    problems: list[str]


FleetEvent = PeerFleetEvent | StoreFleetEvent
"""One pending event naming this VM, as its backend shows it in `maintd fleet` (`source` says which)."""


class Backend(Protocol):
    """Readiness, the right to post, the fleet view and what `status` shows, for one backend."""

    def begin(self) -> None:
        """Start of a tick (loop): take in what arrived since the last one."""

    def inputs(self, event_id: str, event: Event, vm_name: str, pending: Sequence[str], mode: str, manual: bool,
               sent: bool, now: float) -> Inputs:
        """This tick's requests for one event naming this VM, and what the decision needs (loop)."""

    def end(self, events: set[str]) -> None:
        """End of a tick (loop): forget the events not in `events`; publish what the views read."""

    def right_to_post(self, event_id: str, resources: tuple[str, ...], vm_name: str, mode: str,
                      step: Step | None) -> str | None:
        """The backend's part of the recheck right before every send (approver thread): None while this VM
        may post, else why not (and nothing is sent)."""

    def send(self, event_id: str, vm_name: str, step: Step | None, retry_for: float,
             post: Callable[[float], bool]) -> None:
        """Send the approval with `post(within)` (approver thread), with whatever the backend does around it."""

    def gate_states(self) -> FleetStates | None:
        """The fleet gate's input on this backend; None: the gate asks the peers' /v1/health."""

    def hint(self, event_id: str, name: str) -> bool:
        """A peer says it became ready: True if it is asked again at once (any thread)."""

    def view(self, event_id: str) -> EventView:
        """The backend's fields of /v1/events/{id} (any thread)."""

    def status(self, tracked: Mapping[str, Tracked], vm_name: str | None) -> BackendStatus:
        """The backend's part of `maintd status` (any thread)."""

    def fleet(self, tracked: Mapping[str, Tracked], vm_name: str | None, is_ready: Callable[[Tracked], bool],
              approval: Callable[[str], dict[str, Any] | None]) -> list[FleetEvent]:
        """Each pending event naming this VM for `maintd fleet`: its VMs' states, who approved (any thread)."""

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request of the backend is under way (tests, benchmarks)."""

    def stop(self) -> None:
        """Stop the backend's workers."""
