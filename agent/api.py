"""The server's backend: JSON views of the daemon's parts and the mutating operations.

Everything here runs on HTTP server threads; it only reads what the loop and the workers wrote
(state store, health store, tracker snapshot) or records an operator's wish (drain, manual
approval) for the loop to act on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent import __version__
from agent.health import parse_report
from agent.rotation import MANUAL
from agent.server import ApiError, token_ok

if TYPE_CHECKING:
    from agent.daemon import Daemon


def _iso(dt: Any) -> str | None:
    return dt.isoformat().replace("+00:00", "Z") if dt is not None else None


class LocalApi:
    """Implements `server.Backend` over a Daemon."""

    def __init__(self, daemon: "Daemon") -> None:
        self.d = daemon

    def probe(self) -> tuple[bool, str]:
        v = self.d.rotation.verdict()
        return v.in_rotation, v.reason

    def alive(self) -> tuple[bool, str]:
        stuck = self.d.stuck_for()
        if stuck > 0:
            return False, f"the poll loop has not ticked for {stuck:.0f}s longer than it should"
        return True, "the poll loop is ticking"

    def metrics_text(self) -> bytes:
        return self.d.metrics.render()

    def status(self) -> dict[str, Any]:
        d = self.d
        v = d.rotation.verdict()
        since = d.clock.monotonic() - d.last_success if d.last_success is not None else None
        return {
            "version": __version__,
            "vm_name": d.vm_name,
            "dry_run": d.config.dry_run,
            "in_rotation": v.in_rotation,
            "rotation_reason": v.reason,
            "drains": d.rotation.drains(),
            "health": d.health.aggregate(d.config.health.consider_warning_as_error).name.title(),
            "imds": {"endpoint": d.config.imds.endpoint, "last_success_seconds_ago": round(since, 3) if since is not None else None,
                     "consecutive_failures": d.failures, "polls": d.polls,
                     "document_incarnation": d.document.incarnation if d.document else None},
            "events": len(d.tracked),
            "events_naming_this_vm": sum(1 for t in d.tracked.values() if t.names_self),
            "not_ready": {eid: why for eid, t in d.tracked.items()  # outcomes: why the VM is not ready
                          if t.names_self and t.event.status == "Scheduled" and (why := d.runner.not_ready(t))},
            "state": {"dir": str(d.store.dir), "unsaved_changes": d.store.dirty, "write_error": d.store.write_error},
            **d.extra_status(),
        }

    def event(self, event_id: str) -> dict[str, Any] | None:
        d = self.d
        tracked = d.tracked.get(event_id)
        record = d.store.event_record(event_id)
        if tracked is None and record is None:
            return None
        if tracked is not None:
            event = tracked.event.to_json()
            rank = tracked.event.rank(d.vm_name or "")
            names_self, first_seen, present = tracked.names_self, _iso(tracked.first_seen), True
        else:
            assert record is not None
            event, names_self, first_seen, present = record["event"], record.get("names_self"), record.get("first_seen"), False
            rank = None
        return {
            **event,
            "vm_name": d.vm_name,
            "present": present,
            "names_self": names_self,
            "rank": rank,
            "first_seen": first_seen,
            "ready": d.is_ready(event_id),
            "not_ready": d.runner.not_ready(tracked) if tracked is not None and tracked.event.status == "Scheduled" else [],  # outcomes
            "results": d.store.results(event_id),
            "history": (record or {}).get("history", []),
            "outcome": (record or {}).get("outcome"),
            **d.extra_event_view(event_id),
        }

    def events(self) -> list[dict[str, Any]]:
        return [v for v in (self.event(eid) for eid in list(self.d.tracked)) if v is not None]

    def health(self) -> dict[str, Any]:
        return self.d.health.to_json(self.d.config.health.consider_warning_as_error)

    def drain(self, reason: str) -> dict[str, Any]:
        created = self.d.rotation.drain(MANUAL, reason, self.d.clock.now())
        self.d.log.warning("rotation.drained", key=MANUAL, reason=reason, new=created)
        self.d.store.journal("rotation.drained", key=MANUAL, reason=reason)
        saved = {} if self.d.rotation.saved else {"note": "in effect; not yet saved: the state disk refuses writes "  # outcomes
                                                           "(maintd retries; see maintd status)"}
        return {"drained": True, "already": not created, "reason": reason, **saved}

    def undrain(self) -> dict[str, Any]:
        removed = self.d.rotation.undrain(MANUAL)
        self.d.log.info("rotation.undrained", key=MANUAL, was_drained=removed)
        self.d.store.journal("rotation.undrained", key=MANUAL)
        remaining = self.d.rotation.drains()
        return {"undrained": removed, "remaining_drains": remaining}

    def approve(self, event_id: str) -> dict[str, Any]:
        tracked = self.d.tracked.get(event_id)
        if tracked is None:
            raise ApiError(404, f"no current event {event_id}")
        if tracked.event.status != "Scheduled":
            raise ApiError(409, f"event {event_id} is {tracked.event.status}; only Scheduled events can be approved")
        return self.d.manual_approve(event_id)

    def peer_ready(self, event_id: str, body: Any) -> dict[str, Any]:
        vm = body.get("vm") if isinstance(body, dict) else None
        if not isinstance(vm, str) or not vm:
            raise ApiError(400, 'body must be {"vm": "name of the peer that became ready"}')
        return {"event_id": event_id, "asked_again": self.d.coordinator.hint(event_id, vm)}

    def report_health(self, body: Any) -> dict[str, Any]:
        try:
            report = parse_report(body)
            self.d.health.report(report)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return {"accepted": True, "SourceId": report.source_id, "Property": report.property}

    def peer_authorized(self, authorization: str | None) -> bool:
        token = self.d.peer_token()
        return token is None or token_ok(authorization, token)
