"""The blob store backend as the coordinator uses it: its config section, the store and its token, the
inputs to each event's decision, the claim around the POST, and the views.

It is one `agent.coordination.backend.Backend`: the coordinator calls `begin` and `end` around its
tick, `inputs` for each Scheduled event naming this VM; on its approver thread `take_right` (the claim)
before the POST, `right_to_post` (the claim still holds) right before every send, and `settle` (the claim's
outcome) after it. azure-storage-blob is imported by `_open`
only, on a store worker after the loop's first tick (building the daemon, `maintd check-config` and
the peer backend never load it), so the first event does not wait for the import; no request goes
to the store before an event names this VM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict, cast

from agent.clock import Clock
from agent.coordination.backend import (
    BackendParts,
    BackendStatus,
    Carrier,
    EventView,
    FleetEvent,
    FleetVm,
    GateInput,
    Inputs,
    Right,
)
from agent.coordination.backend import Step as BackendStep
from agent.coordination.coordination_rules import OK, UNHEALTHY, UNREACHABLE, peer_state
from agent.coordination.coordination_settings import AzureBlobConfig, CoordinationConfig
from agent.coordination.gate_http import GateClient
from agent.coordination.store.store_claim import Claim, StoreClaims
from agent.coordination.store.store_exchange import FORGED, Store, StoreExchange
from agent.coordination.store.store_protocol import (
    PREPARING,
    READY,
    Fetch,
    Step,
    post_deadline,
    unstorable,
)
from agent.health.health_json import HealthView
from agent.health.health_store import HealthState, HealthStore
from agent.model.approval import IMMEDIATE
from agent.model.events import SCHEDULED, Event
from agent.model.timefmt import iso_z_or_none
from agent.model.tracker import Tracked
from agent.policy.approval_policy import may_approve
from agent.telemetry import logs
from agent.telemetry.metrics import STORE_OPS, Metrics

SOURCE = "coordination"
CONNECTION_STRING_KEY = "coordination.azure_blob.connection_string_file"


def marker_state(pending: Sequence[str]) -> str:
    """What this VM records for an event: ready once no local handler holds it."""
    return PREPARING if pending else READY


def own_health(local_health: HealthView | None, event_id: str, warning_as_error: bool) -> str:
    """This VM's health as the fleet gate counts it (its own reports about the event left out; None, not known:
    unhealthy)."""
    return OK if peer_state(local_health, event_id, warning_as_error) == OK else UNHEALTHY


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


def build(parts: BackendParts) -> StoreBackend:
    """The store backend for `coordination.backend: azure_blob` (`backend_registry`): its section, a managed
    identity's token from IMDS (or the connection string's file)."""
    settings = cast(Callable[[], CoordinationConfig], parts.settings)
    config, token, secret = settings().azure_blob, parts.identity_token, parts.secret
    if config is None or token is None or secret is None or parts.health is None:
        raise ValueError("the store backend needs coordination.azure_blob, IMDS tokens, secret files and health")
    s = settings()
    return StoreBackend(config, token=token, clock=parts.clock, metrics=parts.metrics, health=parts.health,
                        secret=secret, on_change=parts.on_change, takeover_after=lambda: settings().takeover_after,
                        local_health=parts.local_health, warning_as_error=parts.warning_as_error,
                        gate_client=GateClient(s.request_timeout, s.max_concurrency))


class StoreBackend:
    """The coordinator's side of the store: thread use as in `store_exchange` (loop, workers, approver)."""

    def __init__(self, config: AzureBlobConfig, *, token: Fetch, clock: Clock, metrics: Metrics,
                 health: HealthStore, secret: Callable[[str, str | None], str | None],
                 on_change: Callable[[], None], takeover_after: Callable[[], float],
                 local_health: Callable[[], HealthView | None] = lambda: None,
                 warning_as_error: Callable[[], bool] = lambda: False, gate_client: GateClient | None = None) -> None:
        self.gate_client = gate_client or GateClient(2.0, 16)
        """What the Prometheus gate asks with (no peer is asked on this backend)."""
        self.local_health = local_health
        self.warning_as_error = warning_as_error
        self.config = config
        self.token = token
        self.clock = clock
        self.metrics = metrics
        self.health = health
        self.secret = secret
        self.takeover_after = takeover_after
        self.log = logs.get("coordinator")
        self._warmed = False
        for op in STORE_OPS:
            metrics.store_requests.labels(op, "ok")
        self.exchange = StoreExchange(self._open, config.describe, clock, on_change=on_change, report=self._report,
                                      takeover_after=takeover_after,
                                      count_error=metrics.lane_errors.labels("store").inc)
        self.claims = StoreClaims(self.exchange)
        health.set(SOURCE, "store", HealthState.OK, f"{config.describe}: no request yet (none until an event "
                                                     "names this VM)")

    def _open(self) -> Store:
        from agent.coordination.store.blob_store import BlobStore, Settings
        from agent.coordination.store.identity_token import ManagedIdentityCredential

        c = self.config
        count = self._count
        if c.connection_string_file is not None:
            conn = self.secret(CONNECTION_STRING_KEY, c.connection_string_file)
            return BlobStore.open(Settings(c.account_url or "", c.container, connection_string=conn), count)
        credential = ManagedIdentityCredential(self.token, c.client_id, lambda: self.clock.now().timestamp())
        return BlobStore.open(Settings(c.account_url or "", c.container, credential=credential), count)

    def _count(self, op: str, outcome: str) -> None:
        self.metrics.store_requests.labels(op, outcome).inc()

    def _report(self, prop: str, ok: bool, description: str) -> None:
        state = HealthState.OK if ok else HealthState.ERROR if prop == FORGED else HealthState.WARNING
        self.health.set(SOURCE, prop, state, description)

    # --- the loop ------------------------------------------------------------------------------

    def begin(self) -> None:
        """Take in what the store answered since the last tick (on the first, open the store client on a worker)."""
        if not self._warmed:
            self._warmed = True
            self.exchange.warm()
        self.exchange.apply(self.clock.monotonic())

    def inputs(self, event_id: str, event: Event, vm_name: str, pending: Sequence[str], mode: str, manual: bool,
               sent: bool, now: float) -> Inputs:
        """Queue this event's store requests; (the other VMs not recorded ready, no lower-ranked VM to wait for:
        any VM may claim, the protocol's next step). Nothing
        for an event no longer Scheduled or already approved by this VM; lists only while this VM may claim (ready
        and allowed by its profile; `immediate` at once)."""
        resources = event.resources
        if event.status != SCHEDULED or sent:
            return Inputs([], [])
        why = unstorable(event_id, resources)
        if why is not None:
            return Inputs(list(resources), [], Step("wait", f"not coordinated through the store: {why}"))
        mark = (marker_state(pending), own_health(self.local_health(), event_id, self.warning_as_error()))
        allowed = may_approve(mode, pending, manual)
        left = (event.not_before - self.clock.now()).total_seconds() if event.not_before is not None else None
        self.exchange.run(event_id, resources, vm_name, mark, allowed, self.clock.monotonic(), left)
        waiting, step = self.exchange.verdict(event_id, resources, vm_name, self.takeover_after(), mode != IMMEDIATE)
        return Inputs([n for n in waiting if n.casefold() != vm_name.casefold()], [], step)

    def end(self, events: set[str]) -> None:
        """Forget the events no longer in the document; publish the snapshot the API reads."""
        self.exchange.forget(events)
        self.exchange.publish()

    # --- the approver --------------------------------------------------------------------------

    def take_right(self, event_id: str, vm_name: str, step: BackendStep | None, retry_for: float) -> Right | None:
        """The approval's step 2 on the store: the claim (the atomic step), held until `settle`; the right lasts
        until the claim's deadline (half of `takeover_after` from the claim request's start, at most `retry_for`).
        None when another VM claimed it first. Without a step of its own (`inputs` made none), the right as
        decided."""
        if step is None:
            return Right(retry_for)
        claim = self.claims.claim(event_id, vm_name, cast(Step, step))  # a step is this backend's own
        if not claim.won:
            self.log.info("store.claim_lost", event_id=event_id, reason=claim.reason)
            return None
        self.log.info("store.claimed", event_id=event_id, attempt=claim.attempt, reason=claim.reason)
        left = post_deadline(self.takeover_after()) - (self.clock.monotonic() - claim.started)
        if left <= 0:
            self.log.warning("store.claim_too_old", event_id=event_id, effect="not sent: another VM takes it over",
                             reason="claiming took longer than half of takeover_after")
        self.claims.hold(event_id, claim)
        return Right(min(retry_for, left), claim)

    def settle(self, event_id: str, vm_name: str, right: Right, sent: bool | None) -> None:
        """After the sends: the claim is no longer held, and its outcome is recorded on it, `approved`, or
        `released` for another VM to take (nothing when the sends raised: the claim is taken over once old)."""
        if not isinstance(right.held, Claim):
            return
        self.claims.let_go(event_id)
        if sent is not None:
            self.claims.settle(event_id, vm_name, right.held, sent)

    def right_to_post(self, event_id: str, resources: tuple[str, ...], vm_name: str, mode: str,
                      step: BackendStep | None) -> str | None:
        """This VM's claim still holds (`claim_still_holds`), when it claimed."""
        return None if step is None else self.claim_still_holds(event_id)

    def claim_still_holds(self, event_id: str) -> str | None:
        """The approver's check right before every send (the first and each retry): None while this VM's claim
        holds (younger than half of `takeover_after` on the monotonic clock, and the store's record still at the
        ETag the claim wrote and younger than that by the store's clock: one listing), else why not, and nothing is
        sent. What stays open: a pause between this check and the POST reaching IMDS (IMDS takes no fencing token;
        see store_protocol.post_deadline)."""
        return self.claims.holds(event_id, post_deadline(self.takeover_after()))

    # --- views ---------------------------------------------------------------------------------

    def hint(self, event_id: str, name: str) -> bool:
        """No peer is asked on this backend: a peer's hint changes nothing."""
        return False

    def view(self, event_id: str) -> EventView:
        """The peers' fields of /v1/events/{id}, empty: no peer is asked on this backend."""
        return {"acting_leader": None, "readiness_pushed_to": None, "peers_ready": 0, "peers_known": 0, "peers": {}}

    def status(self, tracked: Mapping[str, Tracked], vm_name: str | None) -> BackendStatus:
        """For `maintd status`: the store, its last answer and how long ago."""
        snap = self.exchange.snapshot
        age = None if snap.last_answer_at is None else round(self.clock.monotonic() - snap.last_answer_at, 1)
        return {"coordination": {"backend": "azure_blob", "store": snap.store, "store_last_answer": snap.last_outcome,
                                 "store_last_answer_seconds_ago": age}}

    def fleet(self, tracked: Mapping[str, Tracked], vm_name: str | None, is_ready: Callable[[Tracked], bool],
              approval: Callable[[str], dict[str, Any] | None]) -> list[FleetEvent]:
        """For `maintd fleet`: each event naming this VM still in the document, its VMs and their state as the
        store last said, and who approved (or claimed) and when."""
        return [StoreFleetEvent({"event_id": v.event_id, "source": "store",
                 "vms": [{"name": n, "state": s} for n, s in v.vms],
                 "approval": None if v.approval is None else {
                     "by": v.approval.by, "state": v.approval.state, "attempt": v.approval.attempt,
                     "at": iso_z_or_none(v.approval.at)},
                 "store_error": v.error, "problems": list(v.problems)})
                for v in self.exchange.snapshot.events]

    def gate_input(self) -> GateInput:
        """The fleet gate reads the markers of the last listing; Prometheus is asked with a client of its own."""
        return GateInput(self.gate_client, lambda name: None, self.fleet_states)

    def carrier(self) -> Carrier:
        """The store carries the disruption budget and the fleet history."""
        return Carrier(self.exchange.store, self.config.describe, self.exchange.answers)

    def fleet_states(self, event_id: str, resources: Sequence[str], vm_name: str,
                     warning_as_error: bool) -> dict[str, str]:
        """The fleet gate's input on this backend (approver thread): this VM's health now, the others' as their
        markers said in the last listing (the loop's published snapshot); no marker counts as unreachable."""
        view = next((v for v in self.exchange.snapshot.events if v.event_id == event_id), None)
        health = dict(view.health) if view is not None else {}
        me = own_health(self.local_health(), event_id, warning_as_error)
        return {n: me if n.casefold() == vm_name.casefold() else health.get(n, UNREACHABLE) for n in resources}

    def wait_idle(self, timeout: float) -> bool:
        return self.exchange.wait_idle(timeout)

    def stop(self) -> None:
        self.exchange.stop()
        self.gate_client.close()

