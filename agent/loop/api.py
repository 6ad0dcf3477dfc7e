"""The server's backend: JSON views of the agent's parts and the operator's operations.

Everything here runs on HTTP server threads. It reads what the loop publishes (an immutable
`LoopView`, replaced each tick) and the thread-safe parts it is given (state store, health store,
rotation, readiness, coordinator), and records an operator's wish (drain, manual approval) for the
loop to act on. It never sees the loop itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from agent import __version__
from agent.clock import Clock
from agent.config.config import Config
from agent.coordination import backend_registry
from agent.coordination.backend import BackendStatus, CoordinationView, FleetEvent
from agent.coordination.coordinator import Coordinator
from agent.handlers.base import NOTE_PREFIX
from agent.health.health_json import HealthView
from agent.health.health_store import HealthStore, parse_report
from agent.health.rotation import MANUAL, Drain, Rotation
from agent.http.auth import peer_authorized
from agent.http.routes import ApiError
from agent.model.approval import MANUAL_APPROVAL_KEY
from agent.model.events import SCHEDULED, EventJson
from agent.model.timefmt import iso_z, iso_z_or_none, since_instant
from agent.model.tracker import Tracked, VanishOutcome
from agent.policy.approval_policy import DEFAULT_PROFILE, Profile
from agent.prepare.preparation import Preparation
from agent.prepare.prepare_plan import PlanView
from agent.prepare.readiness import Readiness
from agent.state.state_file import HistoryEntry
from agent.state.state_store import Store
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics

if TYPE_CHECKING:  # the fleet history and the budget are the store backend's: a peers daemon never loads them
    from agent.fleet.budget_wake import WakeAnswer
    from agent.fleet.fleet_history import FleetHistory, HistoryRead

    class FleetHistoryAnswer(HistoryRead):  # decision 0220
        """The answer to GET /v1/fleet/history."""

        backend: str


@dataclass(frozen=True)
class LoopView:
    """What the loop knows that the API shows: published by the loop, never changed in place."""

    config: Config
    vm_name: str | None = None
    tracked: dict[str, Tracked] = field(default_factory=dict)
    incarnation: int | None = None
    failures: int = 0
    polls: int = 0
    last_success: float | None = None
    last_tick: float = 0.0
    profile: Profile = DEFAULT_PROFILE
    profile_next_change: datetime | None = None
    restart_needed: tuple[str, ...] = ()
    """Keys a reload changed that take effect only after a restart (the running values stay)."""

    def stuck_for(self, now: float) -> float:
        """Seconds the loop is past the time it should have ticked again (0 when alive)."""
        c = self.config.imds
        allowance = max(c.poll_interval, c.max_backoff) + c.first_timeout + 5.0
        return max(0.0, now - self.last_tick - allowance)


class ImdsStatus(TypedDict):
    """`maintd status`'s `imds`: the endpoint polled and how the polls go."""

    endpoint: str
    last_success_seconds_ago: float | None
    consecutive_failures: int
    polls: int
    document_incarnation: int | None


class StateStatus(TypedDict):
    """`maintd status`'s `state`: the state directory and whether the disk takes its writes."""

    dir: str
    unsaved_changes: bool
    write_error: str | None


class StatusAnswer(BackendStatus):
    """The answer to GET /v1/status (`maintd status`); the coordination backend's part comes last."""

    version: str
    vm_name: str | None
    dry_run: bool
    in_rotation: bool
    rotation_reason: str
    drains: dict[str, Drain]
    health: str
    imds: ImdsStatus
    events: int
    events_naming_this_vm: int
    not_ready: dict[str, list[str]]
    """Per Scheduled event naming this VM, what keeps it from being ready."""
    state: StateStatus
    profile: str
    profile_approval: str
    profile_next_change: str | None
    restart_needed: list[str]
    notes: dict[str, str]
    cluster: dict[str, str]
    """This node in its HA cluster, by the `pacemaker` handlers' health reports: `<handler>/node` (online, standby,
    the resources on it), `<handler>/hold`, `<handler>/event` -> "State: description"; empty without one."""


CLUSTER_SOURCE = "pacemaker"
"""The SourceId the `pacemaker` handler reports under (`agent.handlers.pacemaker.SOURCE`)."""


class EventDetail(EventJson, CoordinationView):
    """The answer to GET /v1/events/{id} (`maintd events`): the event in IMDS field names, this VM's part in it,
    its results and history, the coordination's fields and the plan."""

    vm_name: str | None
    present: bool
    names_self: bool
    rank: int | None
    first_seen: str | None
    ready: bool
    not_ready: list[str]
    results: dict[str, dict[str, Any]]
    """Key -> a handler's run, the approval record, a handler's note: read back, each its writer's shape."""
    history: list[HistoryEntry]
    outcome: VanishOutcome | None
    plan: PlanView | None


class DrainAnswer(TypedDict):
    """The answer to POST /v1/drain."""

    drained: bool
    already: bool
    reason: str
    note: NotRequired[str]
    """Only while the state disk refuses writes."""


class UndrainAnswer(TypedDict):
    """The answer to POST /v1/undrain."""

    undrained: bool
    remaining_drains: dict[str, Drain]


class ApproveAnswer(TypedDict):
    """The answer to POST /v1/events/{id}/approve."""

    event_id: str
    manual_approval: str


class PeerReadyAnswer(TypedDict):
    """The answer to a peer's POST /v1/events/{id}/ready."""

    event_id: str
    asked_again: bool


class HealthAccepted(TypedDict):
    """The answer to POST /v1/health."""

    accepted: bool
    SourceId: str
    Property: str


class FleetView(TypedDict):
    """The answer to GET /v1/fleet (`maintd fleet`)."""

    vm_name: str | None
    backend: str
    events: list[FleetEvent]
    """Each pending event naming this VM, as the backend shows it (its `source` says which)."""
    budget: NotRequired[dict[str, Any]]
    """The disruption budget's view (store backend with a budget)."""


HISTORY_SINCE = "7d"
"""How far back `/v1/fleet/history` reads without `since`."""


class LocalApi:
    """Implements `server.Backend` over the parts it reads."""

    def __init__(self, view: Callable[[], LoopView], *, store: Store, health: HealthStore, rotation: Rotation,
                 readiness: Readiness, coordinator: Coordinator, preparation: Preparation, metrics: Metrics,
                 clock: Clock,
                 peer_token: Callable[[], str | None], history: FleetHistory | None = None,
                 history_group: Callable[[], str],
                 budget_wake: Callable[[Any], WakeAnswer] | None = None) -> None:
        self.view = view
        self.store = store
        self.health_store = health
        self.rotation = rotation
        self.readiness = readiness
        self.coordinator = coordinator
        self.preparation = preparation
        self.metrics = metrics
        self.clock = clock
        self.peer_token = peer_token
        self.history = history
        self.history_group = history_group
        self._budget_wake = budget_wake
        self.log = logs.get("api")

    def probe(self) -> tuple[bool, str]:
        v = self.rotation.verdict()
        return v.in_rotation, v.reason

    def app_health(self) -> tuple[bool, str]:
        return self.rotation.app_health()

    def alive(self) -> tuple[bool, str]:
        stuck = self.view().stuck_for(self.clock.monotonic())
        if stuck > 0:
            return False, f"the poll loop has not ticked for {stuck:.0f}s longer than it should"
        return True, "the poll loop is ticking"

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def status(self) -> StatusAnswer:
        lv = self.view()
        v = self.rotation.verdict()
        since = self.clock.monotonic() - lv.last_success if lv.last_success is not None else None
        warning_as_error = lv.config.health.consider_warning_as_error
        nxt = lv.profile_next_change
        return {
            "version": __version__,
            "vm_name": lv.vm_name,
            "dry_run": lv.config.dry_run,
            "in_rotation": v.in_rotation,
            "rotation_reason": v.reason,
            "drains": self.rotation.drains(),
            "health": self.health_store.aggregate(warning_as_error).name.title(),
            "imds": {"endpoint": lv.config.imds.endpoint,
                     "last_success_seconds_ago": round(since, 3) if since is not None else None,
                     "consecutive_failures": lv.failures, "polls": lv.polls,
                     "document_incarnation": lv.incarnation},
            "events": len(lv.tracked),
            "events_naming_this_vm": sum(1 for t in lv.tracked.values() if t.names_self),
            "not_ready": {eid: why for eid, t in lv.tracked.items()
                          if t.names_self and t.event.status == SCHEDULED and (why := self.readiness.not_ready(t))},
            "state": {"dir": str(self.store.dir), "unsaved_changes": self.store.dirty,
                      "write_error": self.store.write_error},
            "profile": lv.profile.name, "profile_approval": lv.profile.approval,
            "profile_next_change": iso_z_or_none(nxt),
            "restart_needed": list(lv.restart_needed),
            "notes": self._notes(lv.tracked),
            "cluster": {e.report.property: f"{e.report.state.label}: {e.report.description}"
                        for e in self.health_store.snapshot() if e.report.source_id == CLUSTER_SOURCE},
            **self.coordinator.status(lv.tracked, lv.vm_name),
        }

    def _notes(self, tracked: dict[str, Tracked]) -> dict[str, str]:
        """Per present event, what its handlers keep noted (an Alertmanager silence's id and end), as one line."""
        out = {}
        for eid in tracked:
            lines = [f"{key[len(NOTE_PREFIX):]}: {rec['summary']}" for key, rec in self.store.results(eid).items()
                     if key.startswith(NOTE_PREFIX) and isinstance(rec.get("summary"), str)]
            if lines:
                out[eid] = "; ".join(lines)
        return out

    def fleet(self) -> FleetView:
        """Each pending event naming this VM: the VMs it names, their state, who approved (`maintd fleet`)."""
        lv = self.view()
        mine = {eid: t for eid, t in lv.tracked.items() if t.names_self}
        budget = self.coordinator.budget
        view: FleetView = {"vm_name": lv.vm_name, "backend": lv.config.coordination.backend,
                           "events": self.coordinator.fleet(mine, lv.vm_name, self.readiness.is_ready)}
        if budget is not None:
            view["budget"] = budget.snapshot
        return view

    def fleet_history(self, since: str | None) -> FleetHistoryAnswer:
        """The group's past events from the store (`maintd fleet --history`); 409 on the peer backend."""
        if self.history is None:
            raise ApiError(409, "fleet history needs the store backend (coordination.backend: "
                                f"{' or '.join(backend_registry.shared_store_names())}); "
                                "`maintd events --history` shows this VM's own past events from its audit journal")
        now = self.clock.now()
        try:
            start = since_instant(since or HISTORY_SINCE, now)
        except ValueError as exc:
            raise ApiError(400, f"since: {exc}") from None
        from agent.fleet.fleet_history import HistoryUnreadable

        try:
            return {"backend": self.view().config.coordination.backend,
                    **self.history.read(self.history_group(), start, now)}
        except HistoryUnreadable as exc:
            raise ApiError(503, f"the store did not answer: {exc}") from None

    def _ready(self, tracked: Tracked | None) -> bool:
        """Whether this VM has finished preparing for the event (every scheduled handler settled)."""
        return tracked is not None and tracked.event.status == SCHEDULED and self.readiness.is_ready(tracked)

    def event(self, event_id: str) -> EventDetail | None:
        lv = self.view()
        tracked = lv.tracked.get(event_id)
        record = self.store.event_record(event_id)
        if tracked is None and record is None:
            return None
        coordination = self.coordinator.view(event_id)
        if tracked is not None:
            event = tracked.event.to_json()
            rank = tracked.event.rank(lv.vm_name or "")
            names_self, first_seen, present = tracked.names_self, iso_z_or_none(tracked.first_seen), True
        else:
            assert record is not None
            event, first_seen, present = record["event"], record.get("first_seen"), False
            names_self = bool(record.get("names_self"))
            rank = None
        return {
            **event,
            "vm_name": lv.vm_name,
            "present": present,
            "names_self": names_self,
            "rank": rank,
            "first_seen": first_seen,
            "ready": self._ready(tracked),
            "not_ready": (self.readiness.not_ready(tracked)
                          if tracked is not None and tracked.event.status == SCHEDULED else []),
            "results": self.store.results(event_id),
            "history": record.get("history", []) if record is not None else [],
            "outcome": record.get("outcome") if record is not None else None,
            **coordination,
            "plan": self.preparation.view(event_id, coordination),
        }

    def events(self) -> list[EventDetail]:
        return [v for v in (self.event(eid) for eid in list(self.view().tracked)) if v is not None]

    def health(self) -> HealthView:
        return self.health_store.to_json(self.view().config.health.consider_warning_as_error)

    def drain(self, reason: str, by: str) -> DrainAnswer:
        created = self.rotation.drain(MANUAL, reason, self.clock.now())
        self.log.warning("rotation.drained", key=MANUAL, reason=reason, new=created, by=by)
        self.store.journal("rotation.drained", key=MANUAL, reason=reason, by=by)
        answer: DrainAnswer = {"drained": True, "already": not created, "reason": reason}
        if not self.rotation.saved:
            answer["note"] = ("in effect; not yet saved: the state disk refuses writes "
                              "(maintd retries; see maintd status)")
        return answer

    def undrain(self, by: str) -> UndrainAnswer:
        removed = self.rotation.undrain(MANUAL)
        self.log.info("rotation.undrained", key=MANUAL, was_drained=removed, by=by)
        self.store.journal("rotation.undrained", key=MANUAL, by=by)
        return {"undrained": removed, "remaining_drains": self.rotation.drains()}

    def approve(self, event_id: str, by: str) -> ApproveAnswer:
        """Record an operator's approval (`maintd approve`); the coordinator sends it. `by`: the caller."""
        tracked = self.view().tracked.get(event_id)
        if tracked is None:
            raise ApiError(404, f"no current event {event_id}")
        if tracked.event.status != SCHEDULED:
            raise ApiError(409, f"event {event_id} is {tracked.event.status}; only Scheduled events can be approved")
        self.store.record(event_id, MANUAL_APPROVAL_KEY, {"at": iso_z(self.clock.now()), "by": by},
                          journal="approval.manual")
        self.log.info("approval.manual", event_id=event_id, by=by)
        self.preparation.release(event_id, "operator")  # an operator's go starts a held preparation
        return {"event_id": event_id, "manual_approval": "recorded"}

    def peer_ready(self, event_id: str, body: Any) -> PeerReadyAnswer:
        vm = body.get("vm") if isinstance(body, dict) else None
        if not isinstance(vm, str) or not vm:
            raise ApiError(400, 'body must be {"vm": "name of the peer that became ready"}')
        if isinstance(body, dict) and body.get("health") is not None:  # a ready peer's health changed
            return {"event_id": event_id, "asked_again": self.coordinator.health_hint(event_id, vm)}
        return {"event_id": event_id, "asked_again": self.coordinator.hint(event_id, vm)}

    def budget_wake(self, body: Any) -> WakeAnswer:
        """A wake hint of the disruption budget (`fleet/budget.Budget.wake`); 409 when this VM has no budget."""
        if self._budget_wake is None:
            raise ApiError(409, "no disruption budget here (coordination.budget with backend "
                                f"{' or '.join(backend_registry.shared_store_names())})")
        try:
            return self._budget_wake(body)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    def report_health(self, body: Any) -> HealthAccepted:
        try:
            report = parse_report(body)
            self.health_store.report(report)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return {"accepted": True, "SourceId": report.source_id, "Property": report.property}

    def peer_authorized(self, authorization: str | None) -> bool:
        return peer_authorized(authorization, self.peer_token())
