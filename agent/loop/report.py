"""What the loop tells the operator: transition logs, event metrics, and the health of IMDS and state.

`Reporter` turns what the loop saw (a document, transitions, a failed poll, a handler result, the
state store's write status) into log lines, metrics and health reports. It decides nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from agent.clock import Clock
from agent.config.config import ImdsConfig
from agent.errors import ImdsError, ImdsRequestRejected
from agent.handlers.base import FAILED, OK, TIMED_OUT, Result
from agent.health.health_store import HealthState, HealthStore
from agent.model.events import KNOWN_STATUSES, SCHEDULED, Document
from agent.model.timefmt import iso_z_or_none
from agent.model.tracker import APPEARED, VANISHED, Tracked, Transition
from agent.policy.approval_policy import Profile
from agent.state.state_file import LoadReport
from agent.state.state_store import Store
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics


def next_maintenance(tracked: Iterable[Tracked]) -> dict[str, datetime]:
    """Earliest NotBefore per event type among the Scheduled events naming this VM."""
    out: dict[str, datetime] = {}
    for t in tracked:
        nb = t.event.not_before
        if t.names_self and t.event.status == SCHEDULED and nb is not None:
            label = t.event.type_label
            out[label] = min(out.get(label, nb), nb)
    return out


class Reporter:
    """Log lines, metrics and health reports for what the loop saw."""

    def __init__(self, metrics: Metrics, health: HealthStore, clock: Clock) -> None:
        self.metrics = metrics
        self.health = health
        self.clock = clock
        self.log = logs.get("daemon")
        self._poll_errors = logs.RepeatLimiter()
        self._failing = False
        self._state_failing = False
        self._state_failures_seen = 0

    def follow_loop(self, last_tick: Callable[[], float], last_success: Callable[[], float | None]) -> None:
        """The loop's tick and last successful poll as Unix times, computed when scraped (no per-poll work)."""
        self.metrics.loop_last_tick.set_function(lambda: self._wall_time(last_tick()))
        self.metrics.poll_last_success.set_function(lambda: self._wall_time(last_success()))

    def _wall_time(self, monotonic: float | None) -> float:
        """Unix time of a moment on the monotonic clock (0 for never)."""
        if monotonic is None:
            return 0.0
        return self.clock.now().timestamp() - (self.clock.monotonic() - monotonic)

    # --- polls --------------------------------------------------------------------------

    def poll_failed(self, exc: ImdsError, failures: int) -> None:
        self.metrics.poll_failures.set(failures)
        self._failing = True
        verdict = self._poll_errors.failure(f"{type(exc).__name__}:{exc.status}", self.clock.monotonic())
        fields: dict[str, Any] = {"error": str(exc), "code": exc.code, "failures": failures}
        if exc.body:
            fields["body"] = exc.body[:500]
        if isinstance(exc, ImdsRequestRejected):
            fields["hint"] = ("IMDS says maintd's request is malformed: check imds.api_version, and that no proxy "
                              "or X-Forwarded-For header is in the path")
        if verdict == "first":
            self.log.error("poll.failed", **fields)
        elif verdict == "summary":
            self.log.error("poll.still_failing", **fields, since_seconds=round(
                self.clock.monotonic() - (self._poll_errors.first_at or 0), 1))
        if isinstance(exc, ImdsRequestRejected):
            self.health.set("imds", "request", HealthState.ERROR, f"IMDS rejected maintd's request ({exc.status}): "
                            f"{exc.body[:200]}")

    def poll_succeeded(self) -> None:
        """After a failure streak: log the recovery, zero the failure gauge, drop the request report."""
        if not self._failing:
            return
        self._failing = False
        streak = self._poll_errors.success()
        if streak:
            self.log.info("poll.recovered", failed_polls=streak)
        self.metrics.poll_failures.set(0)
        self.health.remove("imds", "request")

    def imds_health(self, c: ImdsConfig, failures: int, last_success: float | None, started_at: float) -> None:
        """imds/poll: Error when stale, Warning after a few failures, Ok while polling."""
        now = self.clock.monotonic()
        since = last_success if last_success is not None else started_at
        if failures and now - since >= c.stale_after:
            report = (HealthState.ERROR, f"no successful poll for {now - since:.0f}s ({failures} failed in a row)")
        elif failures >= c.warn_after_failures:
            report = (HealthState.WARNING, f"{failures} polls failed in a row")
        elif last_success is not None:
            report = (HealthState.OK, "polling")
        else:
            return
        self.health.set("imds", "poll", *report)

    def profile(self, profile: Profile, previous: Profile | None, profiles: Iterable[Profile]) -> None:
        """The profile_active gauges and a profile.changed line when the profile in force changes."""
        if previous is not None and previous.name == profile.name:
            return
        for p in profiles:
            self.metrics.profile_active.labels(p.name).set(1 if p.name == profile.name else 0)
        if previous is not None:
            self.log.info("profile.changed", profile=profile.name, previous=previous.name, approval=profile.approval)

    # --- documents and transitions --------------------------------------------------------

    def document(self, document: Document, previous: Document | None) -> None:
        """Incarnation going backwards, malformed events skipped, the incarnation gauge."""
        if previous and previous.incarnation is not None and document.incarnation is not None \
                and document.incarnation < previous.incarnation:
            self.log.warning("imds.incarnation_reset", previous=previous.incarnation, current=document.incarnation)
        for skipped in document.skipped:
            self.metrics.events_malformed.inc()
            self.log.warning("event.malformed", index=skipped.index, reason=skipped.reason, event_id=skipped.event_id)
        if document.incarnation is not None:
            self.metrics.document_incarnation.set(document.incarnation)

    def transition(self, tr: Transition) -> None:
        e = tr.event
        self.metrics.transitions.labels(tr.kind, e.type_label).inc()
        fields: dict[str, Any] = {"event_id": e.event_id, "event_type": e.event_type, "status": e.status,
                                  "names_self": tr.names_self, "resources": len(e.resources)}
        if tr.kind == APPEARED:
            fields.update(not_before=iso_z_or_none(e.not_before), source=e.source,
                          duration_seconds=e.duration_seconds, live_migration=e.live_migration,
                          description=e.description)
            if e.not_before is not None:
                notice = (e.not_before - tr.at).total_seconds()
                fields["notice_seconds"] = round(notice, 1)
                self.metrics.event_notice.labels(e.type_label).observe(max(0.0, notice))
        if tr.previous_status:
            fields["previous_status"] = tr.previous_status
        name = f"event.{tr.outcome}" if tr.kind == VANISHED and tr.outcome else f"event.{tr.kind}"
        self.log.info(name, **fields)

    def events(self, tracked: dict[str, Tracked]) -> None:
        """Event gauges, next maintenance per type, and the maintenance/pending health report."""
        counts: dict[tuple[str, ...], float] = {}
        for t in tracked.values():
            key = (t.event.type_label, t.event.status if t.event.status in KNOWN_STATUSES else "Other",
                   "self" if t.names_self else "other")
            counts[key] = counts.get(key, 0) + 1
        self.metrics.swap(self.metrics.events, counts)
        self.metrics.swap(self.metrics.next_maintenance,
                          {(label,): when.timestamp() for label, when in next_maintenance(tracked.values()).items()})
        pending = [t for t in tracked.values() if t.names_self]
        if pending:
            self.health.set("maintenance", "pending", HealthState.OK,
                            ", ".join(f"{t.event.event_type} {t.event.status}" for t in pending))
        else:
            self.health.remove("maintenance", "pending")

    def handler_result(self, event_id: str, handler: str, phase: str, result: Result) -> None:
        if result.outcome in (FAILED, TIMED_OUT):
            self.health.set("handlers", handler, HealthState.WARNING,
                            f"{phase} run for {event_id} {result.outcome}: {result.detail}"[:500])
        elif result.outcome == OK:
            self.health.remove("handlers", handler)

    # --- state ----------------------------------------------------------------------------

    def state_loaded(self, store: Store) -> LoadReport:
        """Load the state file; a bad one is reported (and was moved aside by the store)."""
        report = store.load()
        for aside in report.journal_aside:
            self.log.warning("journal.newer_format", moved_aside=aside, hint="written by a newer maintd; "
                             "kept for it, never appended to here; a new journal file is started")
        if report.problem:
            self.metrics.state_load_failures.inc()
            self.log.error("state.newer_format" if report.newer_format else
                           "state.corrupt" if report.moved_aside else "state.unreadable", problem=report.problem,
                           moved_aside=report.moved_aside, path=str(store.path))
            self.health.set("state", "load", HealthState.WARNING, f"{report.problem}; started fresh"
                            + (f" (old file kept at {report.moved_aside})" if report.moved_aside else ""))
        return report

    def state_write_status(self, store: Store, retry: bool = True) -> None:
        """Retry a pending write (in the background); report the disk's state whichever thread's write failed.
        The one place that logs `state.write_failed`: writers on other threads leave it to this."""
        if retry and store.dirty:
            store.save_soon()
        failures = store.write_failures
        if failures > self._state_failures_seen:
            self.metrics.state_write_failures.inc(failures - self._state_failures_seen)
            self._state_failures_seen = failures
        error = store.write_error
        if error and not self._state_failing:
            self._state_failing = True
            self.log.error("state.write_failed", error=error, hint="free space or make the state dir writable; "
                           "changes are kept in memory and written when the disk accepts them")
            self.metrics.state_dirty.set(1)
            self.health.set("state", "write", HealthState.ERROR, f"state not saved: {error}")
        elif self._state_failing and not error and not store.dirty:
            self._state_failing = False
            self.metrics.state_dirty.set(0)
            self.log.info("state.write_recovered")
            self.health.set("state", "write", HealthState.OK, "state saved")
