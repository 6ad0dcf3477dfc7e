"""Runs handlers on worker threads: per event in sequence (phase by phase, handler by handler),
different events in parallel, each run at most once per (EventId, handler, phase) across restarts.

Before a handler starts, `{"outcome": "running"}` is recorded; its result replaces that record
before anything acts on it. A `running` record found at start means maintd died mid-run:
idempotent handlers (drain, health) run again, others are recorded `failed` ("interrupted") and
never re-run. A handler's time budget is its `timeout`, capped in the `scheduled` phase by the
time left before NotBefore minus `DEADLINE_MARGIN`; one that cannot start in time is recorded
`skipped` ("deadline").
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any, Callable

from agent import logs
from agent.errors import StateError
from agent.events import Event
from agent.handlers.base import FAILED, OK, SKIPPED, TIMED_OUT, Context, Handler, Result
from agent.lanes import Lanes
from agent.tracker import Tracked, Transition

DEADLINE_MARGIN = 5.0
"""Seconds kept free before NotBefore: a handler budget never reaches into them."""
OUTPUT_TAIL = 4000


def phase_for(tr: Transition) -> str | None:
    """The handler phase a transition starts (None when there is none)."""
    if tr.kind == "vanished":
        return "completed"
    if tr.event.status == "Scheduled" and tr.kind == "appeared":
        return "scheduled"
    if tr.event.status == "Started":
        return "started"
    return None


def result_key(handler: str, phase: str) -> str:
    """The state-store key of a handler's result."""
    return f"handler:{handler}:{phase}"


def budget(timeout: float, phase: str, not_before: datetime | None, now: datetime) -> float:
    """Seconds a run may take: its timeout, capped before NotBefore in the scheduled phase (≤ 0: too late)."""
    if phase != "scheduled" or not_before is None:
        return timeout
    return min(timeout, (not_before - now).total_seconds() - DEADLINE_MARGIN)


class Runner:
    """Owns the handler worker threads; thread-safe."""

    def __init__(self, handlers: list[Handler], services: Any, *, dry_run: bool = False, max_workers: int = 8,
                 on_result: Callable[[str, str, str, Result], None] | None = None) -> None:
        self.handlers = handlers
        self.services = services
        self.clock = services.clock
        self.store = services.store
        self.metrics = services.metrics
        self.dry_run = dry_run
        self.on_result = on_result
        self.log = logs.get("runner")
        self.cancel = threading.Event()
        self._lanes = Lanes(max_workers, "handler")
        for h in handlers:
            self.metrics.init_handler(h.spec.name, h.spec.phases)

    # --- scheduling -----------------------------------------------------------------------

    def submit(self, tr: Transition) -> None:
        """Queue the phase a transition starts for its event."""
        phase = phase_for(tr)
        if phase is not None:
            self._enqueue(tr.event.event_id, (phase, tr.event, tr.names_self, tr.outcome))

    def resume(self, tracked: dict[str, Tracked]) -> None:
        """After a restart: settle interrupted runs, then queue the phase each present event is in."""
        for eid, t in tracked.items():
            for key, rec in self.store.results(eid).items():
                if key.startswith("handler:") and rec.get("outcome") == "running":
                    self._settle_interrupted(eid, key, rec)
            phase = "scheduled" if t.event.status == "Scheduled" else "started" if t.event.status == "Started" else None
            if phase:
                self._enqueue(eid, (phase, t.event, t.names_self, None))

    def _settle_interrupted(self, event_id: str, key: str, rec: dict[str, Any]) -> None:
        name = key.split(":")[1]
        handler = next((h for h in self.handlers if h.spec.name == name), None)
        if handler is not None and handler.idempotent:
            self._record(event_id, key, None)
            self.log.warning("handler.interrupted", event_id=event_id, handler=name, action="will run again (idempotent)")
            return
        result = {**rec, "outcome": FAILED, "detail": "interrupted: maintd stopped while it ran; not run again"}
        self._record(event_id, key, result, journal="handler.interrupted")
        self.log.error("handler.interrupted", event_id=event_id, handler=name, action="recorded failed, not re-run")

    def _enqueue(self, event_id: str, job: tuple[str, Event, bool, str | None]) -> None:
        self._lanes.submit(event_id, lambda: self._run_phase_logged(*job))

    def _run_phase_logged(self, phase: str, event: Event, names_self: bool, outcome: str | None) -> None:
        try:
            self._run_phase(phase, event, names_self, outcome)
        except Exception as exc:  # never lose the lane: log and go on with the event's next phase
            self.log.error("runner.internal_error", event_id=event.event_id, phase=phase, error=repr(exc),
                           exc_info=True)

    # --- running --------------------------------------------------------------------------

    def selected(self, phase: str, event: Event, names_self: bool) -> list[Handler]:
        """The handlers that run for this event in this phase, in order (narrowed by the profile in force)."""
        profile = self.services.profile
        allowed = profile.handlers if profile is not None else None
        return [h for h in self.handlers if phase in h.spec.phases and h.spec.applies_to(event, names_self)
                and (allowed is None or h.spec.name in allowed)]

    def _run_phase(self, phase: str, event: Event, names_self: bool, outcome: str | None) -> None:
        for handler in self.selected(phase, event, names_self):
            if self.cancel.is_set():
                return
            key = result_key(handler.spec.name, phase)
            if self.store.result(event.event_id, key) is not None:
                continue
            if self.dry_run and not handler.spec.dry_run:
                self.log.info("handler.dry_run_skipped", event_id=event.event_id, handler=handler.spec.name, phase=phase)
                continue
            self._run_one(handler, phase, event, names_self, outcome, key)

    def _run_one(self, handler: Handler, phase: str, event: Event, names_self: bool, outcome: str | None,
                 key: str) -> None:
        spec = handler.spec
        now = self.clock.now()
        base = max(spec.timeout, handler.minimum_timeout())
        allowed = budget(base, phase, event.not_before, now)
        fields = {"event_id": event.event_id, "event_type": event.event_type, "handler": spec.name, "phase": phase}
        if allowed <= 0:
            self.metrics.deadline_short.inc()
            self.log.warning("deadline.short", **fields, action="skipped", seconds_left=round(allowed + DEADLINE_MARGIN, 1))
            self._finish(handler, phase, event, key, Result(SKIPPED, "deadline: too close to NotBefore to start"), 0.0, now)
            return
        if allowed < base:
            self.metrics.deadline_short.inc()
            self.log.warning("deadline.short", **fields, action="budget cut", timeout=round(allowed, 1),
                             configured=round(base, 1))
        started_at = now.isoformat()
        self._record(event.event_id, key, {"outcome": "running", "started_at": started_at})
        self.log.info("handler.started", **fields, timeout=round(allowed, 1))
        ctx = Context(event=event, phase=phase, vm_name=self.services.vm_name or "", names_self=names_self,
                      timeout=allowed, deadline=event.not_before, dry_run=self.dry_run, clock=self.clock,
                      cancel=self.cancel, outcome=outcome)
        t0 = self.clock.monotonic()
        result = self._call(handler, ctx, allowed)
        if result is None:
            self.log.warning("handler.abandoned", **fields, reason="maintd is stopping; the run will be settled at restart")
            return
        self._finish(handler, phase, event, key, result, self.clock.monotonic() - t0, now)

    def _call(self, handler: Handler, ctx: Context, allowed: float) -> Result | None:
        """Run on a helper thread so a hung handler costs its budget, not the worker."""
        box: list[Result] = []

        def target() -> None:
            try:
                box.append(handler.run(ctx))
            except Exception as exc:
                box.append(Result(FAILED, f"{type(exc).__name__}: {exc}"))

        thread = threading.Thread(target=target, name=f"h-{handler.spec.name}", daemon=True)
        thread.start()
        thread.join(allowed + 5.0)
        if box:
            if self.cancel.is_set() and box[0].outcome != OK:
                return None
            return box[0]
        if self.cancel.is_set():
            return None
        return Result(TIMED_OUT, f"still running after {allowed:.0f}s; abandoned")

    def _finish(self, handler: Handler, phase: str, event: Event, key: str, result: Result, duration: float,
                started: datetime) -> None:
        spec = handler.spec
        record = {"outcome": result.outcome, "detail": result.detail, "duration_seconds": round(duration, 3),
                  "started_at": started.isoformat(), "finished_at": self.clock.now().isoformat(),
                  "on_failure": spec.on_failure}
        if result.exit_code is not None:
            record["exit_code"] = result.exit_code
        if result.output:
            record["output"] = result.output[-OUTPUT_TAIL:]
        self._record(event.event_id, key, record, journal="handler.finished")
        self.metrics.handler_runs.labels(spec.name, phase, result.outcome).inc()
        self.metrics.handler_duration.labels(spec.name, phase).observe(duration)
        level = "info" if result.outcome in (OK, SKIPPED) else "error"
        getattr(self.log, level)("handler.finished", event_id=event.event_id, event_type=event.event_type,
                                 handler=spec.name, phase=phase, outcome=result.outcome, detail=result.detail,
                                 exit_code=result.exit_code, duration_seconds=round(duration, 3))
        if self.on_result:
            self.on_result(event.event_id, spec.name, phase, result)

    def _record(self, event_id: str, key: str, value: dict[str, Any] | None, journal: str | None = None) -> None:
        try:
            if value is None:
                self.store.clear_result(event_id, key)
            else:
                self.store.record(event_id, key, value, journal=journal)
        except StateError as exc:
            self.log.error("state.write_failed", event_id=event_id, key=key, error=str(exc),
                           hint="kept in memory; written when the disk accepts it")

    # --- readiness and lifecycle ----------------------------------------------------------

    def pending(self, t: Tracked) -> list[str]:
        """Scheduled-phase handlers that keep the VM from being ready for this event."""
        if self.dry_run:
            return []
        waiting = []
        for handler in self.selected("scheduled", t.event, t.names_self):
            rec = self.store.result(t.event.event_id, result_key(handler.spec.name, "scheduled"))
            outcome = rec.get("outcome") if rec else None
            if outcome == OK or (outcome in (FAILED, TIMED_OUT, SKIPPED) and handler.spec.on_failure == "continue"):
                continue
            waiting.append(handler.spec.name)
        return waiting

    def is_ready(self, t: Tracked) -> bool:
        """Every scheduled handler finished ok (or failed under on_failure: continue)."""
        return not self.pending(t)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no event has queued or running work (tests, shutdown)."""
        return self._lanes.wait_idle(timeout)

    def stop(self, grace: float) -> None:
        """Let running handlers finish for up to `grace` seconds, then cut them short."""
        if not self.wait_idle(grace):
            self.log.warning("runner.cancelling", running=sorted(map(str, self._lanes.busy())))
        self.cancel.set()
        self._lanes.shutdown()
