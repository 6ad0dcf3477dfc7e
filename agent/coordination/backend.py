"""The one interface the coordinator has to a coordination backend, and what a backend is built from.

A backend lives in a package of its own (the built-ins: the peers, `coordination/peers/`, and a blob store,
`coordination/store/`), owns its settings' meaning and its views, and is registered by name in one place,
`backend_registry` (`coordination.backend` chooses it): this module, the coordinator and the approver name
none, and import none of them (tests/project/test_house.py holds it).

The coordinator decides, orders and publishes; it knows no backend by name. Per tick, on the loop's
thread: `begin`, then `inputs` for each event naming this VM (what the decision needs: who is not
ready, who ranks before this VM and is still there, the backend's step), then `end` with the events
still followed. On the approver thread, the backend's three parts of the approval (`approver`): `take_right`
before it (the store claims), `right_to_post` right before every send, `settle` after it (the store records
`approved` or `released` on its claim). Views (any thread): `hint`, `view`, `status`,
`fleet`, and `gate_input` for the gates (the fleet gate's input, the HTTP client they ask Prometheus with);
`carrier` for what the fleet wing (the disruption budget, the fleet history) is carried by, if anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict

from agent.clock import Clock
from agent.health.health_json import HealthView
from agent.health.health_store import HealthStore
from agent.model.approval import ApprovalView
from agent.model.events import Event
from agent.model.identity import Identity
from agent.model.tracker import Tracked
from agent.telemetry.metrics import Metrics

FleetStates = Callable[[str, Sequence[str], str, bool], dict[str, str]]
"""(event id, Resources, this VM, warning as error) -> each VM's ok / unhealthy / unreachable: asked of the
peers' /v1/health, or read from what the backend last listed (the store: their markers)."""


class Step(Protocol):
    """A backend's protocol step for one event (the store's: wait, claim, take over, done)."""

    @property
    def action(self) -> str: ...

    @property
    def reason(self) -> str: ...


class GateHttp(Protocol):
    """The HTTP the gates ask with: a VM's /v1/health (the peers' fleet gate), Prometheus' API."""

    def health(self, base: str) -> Any: ...

    def prometheus(self, base: str, path: str, timeout: float, params: dict[str, str] | None = None) -> Any: ...


@dataclass(frozen=True)
class GateInput:
    """What the gates read on this backend: their HTTP client, where a VM's /v1/health is (by name), and the fleet
    gate's states when the backend has them itself (None: each VM's /v1/health is asked)."""

    client: GateHttp
    health_url: Callable[[str], str | None]
    states: FleetStates | None = None


@dataclass(frozen=True)
class Carrier:
    """A shared store a backend offers the fleet wing (the disruption budget, the fleet history): its handle,
    how `maintd status` names it, and its answers' record (Retry-After)."""

    store: Any
    describe: str
    answers: Any


@dataclass(frozen=True)
class Right:
    """The right to post one approval, as the backend granted it (`take_right`): for how long this VM may send
    (seconds, at most the order's `retry_for`; 0 or less: granted too late to send), and what the backend settles
    it with afterwards (the store's claim; None on a backend that keeps nothing)."""

    within: float
    held: object = None


@dataclass(frozen=True)
class BackendParts:
    """What a backend is built from (`backend_registry`): the `coordination:` settings in force (a getter: a
    reload replaces them), and the parts of the agent it may use. A backend takes the ones it needs."""

    settings: Callable[[], Any]
    """The `coordination:` section in force (`CoordinationConfig`; the backend reads its own keys)."""
    clock: Clock
    metrics: Metrics
    health: HealthStore | None = None
    on_change: Callable[[], None] = lambda: None
    """Wakes the loop for a tick (a VM's word, an answer came in)."""
    poll_interval: Callable[[], float] = lambda: 1.0
    token_reader: Callable[[], str | None] = lambda: None
    """The shared token peers send on /v1 reads (`coordination.token_file`)."""
    identity: Callable[[], Identity | None] = lambda: None
    """This VM's identity from IMDS compute (None until learnt)."""
    local_health: Callable[[], HealthView | None] = lambda: None
    warning_as_error: Callable[[], bool] = lambda: False
    identity_token: Callable[[str, str | None], Any] | None = None
    """A managed identity's token from IMDS (resource, client id)."""
    secret: Callable[[str, str | None], str | None] | None = None
    """A secret file's content (config key, path), reported when it cannot be read."""


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


class BackendStatus(TypedDict):
    """A backend's part of `maintd status`: `coordination` (its `backend` name first, then what it shows: the peers'
    sources, the store and its last answer); the peers backend adds each pending event's peers (name: its line)."""

    coordination: Mapping[str, object]
    peers: NotRequired[dict[str, dict[str, str]]]


class FleetVm(TypedDict):
    """One VM an event names, as `maintd fleet` shows it."""

    name: str
    state: str


FleetEvent = Mapping[str, object]
"""One pending event naming this VM, as its backend shows it in `maintd fleet`: `event_id`, `source` (which
backend's word), `vms` (`FleetVm`s), `approval`, and what else the backend shows (its own TypedDict)."""


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

    def take_right(self, event_id: str, vm_name: str, step: Step | None, retry_for: float) -> Right | None:
        """The approval's step 2 (approver thread): take the right to post (the store: claim the event), or None
        when another VM has it (nothing is sent, nothing to settle)."""

    def settle(self, event_id: str, vm_name: str, right: Right, sent: bool | None) -> None:
        """After the sends (approver thread): give the right back, recording whether the approval was `sent` (the
        store: `approved`, or `released` for another VM to take at once); None: the sends ended in an error that
        says neither (the store records nothing: its claim is taken over once it is old)."""

    def gate_input(self) -> GateInput:
        """What the gates read on this backend (see `GateInput`)."""

    def carrier(self) -> Carrier | None:
        """The shared store the fleet wing is carried by; None: no budget, no fleet history on this backend."""

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
