"""Runs handlers on worker threads: per event in sequence (phase by phase, handler by handler),
different events in parallel, each run recorded once per (EventId, handler, phase) across restarts.

Before a handler starts, `{"outcome": "running", "attempt": n}` is recorded; its result replaces
that record before anything acts on it. A `running` record found at start means maintd died (or
stopped) mid-run: the run is recorded `interrupted` and runs again with `MAINTD_ATTEMPT=n+1`, up
to the handler's `max_attempts` (at-least-once); with `rerun_interrupted: false`, or once the
attempts are used up, it is recorded `failed` and not run again (at-most-once).

When an event leaves the document, its `scheduled`/`started` work is cut: the run under way gets
the event's cancel flag (a drain wait ends, an exec hook gets SIGTERM), the handlers not yet run
are recorded `skipped`, and the `completed` phase runs at once on its own lane, beside the cut run.

A handler's time budget is its `timeout`, capped in the `scheduled` phase by the time left before
NotBefore minus `DEADLINE_MARGIN`; one that cannot start in time is recorded `skipped` ("deadline").
A phase waits for a holding handler's whole run, for a non-holding one's first try only: past it the
run goes on in the background (`background_runs`), recorded `running` with `background: true`, and
the phase goes on; a `before_drain` handler runs right before the drain (`run_order`, decision 0236).
What the records say of an event (ready, why not, its work done) is read by `readiness.py`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from functools import partial
from typing import Any

from agent.errors import kept_in_memory
from agent.handlers.base import Context, Handler, Result, Services
from agent.lanes import Lanes
from agent.model.events import Event, parse_event
from agent.model.outcomes import (
    CANCELED,
    FAILED,
    INTERRUPTED,
    OK,
    PHASE_COMPLETED,
    PHASE_SCHEDULED,
    RUNNING,
    SKIPPED,
)
from agent.model.timefmt import iso_z
from agent.model.tracker import Tracked, Transition, phase_for, phase_in
from agent.prepare.background_runs import BackgroundRuns, RunThread
from agent.prepare.run_order import FIRST_TRY, budget, holds, run_order, short_budget
from agent.prepare.run_records import (
    LEFT_THE_DOCUMENT,
    PLACE_LOST,
    RunKey,
    RunRecord,
    attempt_of,
    finished_record,
    interrupted_verdict,
    round_of,
    run_result,
)
from agent.telemetry import logs

ResultListener = Callable[[str, str, str, Result], None]
"""Hears of each finished run, and of a run that went on in the background (outcome `running`): readiness may
have changed."""


class Cut(threading.Event):
    """An event's cancel flag, and why its work was cut (the records' words: `run_records`)."""

    why = LEFT_THE_DOCUMENT

    def cut(self, why: str, outcome: str | None) -> str:
        """Set, for `why` ("": the event left the document, as `outcome`); the reason its log lines give."""
        self.why = why or self.why
        self.set()
        return why or f"event {outcome or 'gone'}"


def why_cut(cut: threading.Event) -> str:
    return cut.why if isinstance(cut, Cut) else LEFT_THE_DOCUMENT


def settles(run: RunKey, phase: str | None, restore: int, rnd: int) -> bool:
    """Whether settling the `running` records of an event in `phase` (in round `rnd`) settles `run`'s: with
    `restore`, only that round's (a lost place's return to rotation, once the cut work on its lane is done: what
    is still `running` then a crash cut; its `completed` runs go again); else all but a restore's while the event
    is still Scheduled (the restore settles those, and runs them again)."""
    if restore:
        return run.round == restore and run.phase in (PHASE_SCHEDULED, PHASE_COMPLETED)
    return not (phase == PHASE_SCHEDULED and run.phase == PHASE_COMPLETED and run.round < rnd)


class Runner:
    """Owns the handler worker threads; thread-safe."""

    def __init__(self, handlers: list[Handler], services: Services, *, dry_run: bool = False, max_workers: int = 8,
                 on_result: ResultListener | None = None) -> None:
        self.handlers = handlers
        self.services = services
        self.clock = services.clock
        self.store = services.store
        self.metrics = services.metrics
        self.dry_run = dry_run
        self.on_result = on_result
        self.log = logs.get("runner")
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._cuts: dict[str, Cut] = {}
        """Per present event: set when it leaves the document (or maintd stops) to cut its work short."""
        self._running: dict[str, str] = {}
        """Per event: the scheduled/started handler running now."""
        self._lanes = Lanes(max_workers, "handler")
        self._background = BackgroundRuns(max_workers)
        for h in handlers:
            self.metrics.init_handler(h.spec.name, h.spec.phases)

    # --- scheduling -----------------------------------------------------------------------

    def submit(self, tr: Transition) -> None:
        """Queue the phase a transition starts; a vanished event first cuts its pending work short."""
        phase = phase_for(tr)
        if phase == PHASE_COMPLETED:
            self._preempt(tr.event.event_id, tr.outcome)
        if phase is not None:
            self._enqueue(phase, tr.event, tr.names_self, tr.outcome)

    def resume(self, tracked: dict[str, Tracked]) -> None:
        """After a restart: settle interrupted runs, then queue the phase each present event is in, and
        the `completed` phase of a gone event whose completed run was interrupted (the undrain, say)."""
        for eid, t in tracked.items():
            phase = phase_in(t.event)
            self._settle(eid, phase)
            if phase:
                self._enqueue(phase, t.event, t.names_self, None)
        for eid, rec in self.store.event_records().items():
            if eid not in tracked and rec.get("vanished_at") and self._settle(eid, PHASE_COMPLETED):
                self._enqueue(PHASE_COMPLETED, parse_event(rec["event"]), bool(rec.get("names_self")),
                              rec.get("outcome"))

    def _settle(self, event_id: str, phase: str | None, restore: int = 0) -> bool:
        """Settle the `running` records `settles` picks: `phase`'s may run again, the others not; True if one will."""
        again, results = False, self.store.results(event_id)
        for key, rec in results.items():
            run = RunKey.parse(key)
            if run is not None and rec.get("outcome") == RUNNING and settles(run, phase, restore, round_of(results)):
                again |= self._settle_interrupted(event_id, run, rec, run.phase == phase)
        return again

    def _settle_interrupted(self, event_id: str, run: RunKey, rec: dict[str, Any], current: bool) -> bool:
        """Record an interrupted run as to run again, or failed; True when it runs again."""
        key, name = str(run), run.handler
        handler = next((h for h in self.handlers if h.spec.name == name), None)
        attempt = attempt_of(rec)
        fields = {"event_id": event_id, "handler": name, "attempt": attempt}
        again, why = interrupted_verdict(handler.spec if handler else None, attempt, current)
        if again and handler is not None:
            self._record(event_id, key, {**rec, "outcome": INTERRUPTED, "attempt": attempt, "detail": why},
                         journal="handler.interrupted")
            self.log.warning("handler.interrupted", **fields, max_attempts=handler.spec.max_attempts,
                             action="runs again")
            return True
        self._record(event_id, key, {**rec, "outcome": FAILED, "detail": why}, journal="handler.interrupted")
        self.log.error("handler.interrupted", **fields, detail=why, action="recorded failed, not run again")
        return False

    def _enqueue(self, phase: str, event: Event, names_self: bool, outcome: str | None, restore: int = 0) -> None:
        eid, rnd = event.event_id, restore or round_of(self.store.results(event.event_id))  # a later one changes none
        if phase == PHASE_COMPLETED:  # own lane, never behind the cut work (`restore`: a lost place's, before a round)
            cut, lane = self.stopping, (eid, "present" if restore else phase)
        else:
            with self._lock:
                cut, lane = self._cuts.setdefault(eid, Cut()), (eid, "present")
        self._lanes.submit(lane, lambda: self._run_phase_logged(phase, event, names_self, outcome, cut, rnd))

    def restore(self, event: Event, names_self: bool, rnd: int) -> None:
        """A lost budget place (B2): the scheduled work cut, then `completed` of round `rnd` (again at a restart)."""
        self._preempt(event.event_id, "place lost", PLACE_LOST)
        self._enqueue(PHASE_COMPLETED, event, names_self, CANCELED, restore=rnd)

    def _preempt(self, event_id: str, outcome: str | None, why: str = "") -> None:
        """Cut the event's scheduled/started work (for `why`): the run under way ends early, the rest is skipped."""
        with self._lock:
            cut = self._cuts.pop(event_id, None)
            running = self._running.get(event_id)
        if cut is None:
            return
        reason = cut.cut(why, outcome)
        for name in ([running] if running is not None else []) + self._background.names(event_id):
            self.log.warning("handler.canceling", event_id=event_id, handler=name, reason=reason)

    def _run_phase_logged(self, phase: str, event: Event, names_self: bool, outcome: str | None,
                          cut: threading.Event, rnd: int = 1) -> None:
        try:
            if phase == PHASE_COMPLETED and rnd < round_of(self.store.results(event.event_id)):  # a restore, after the
                self._settle(event.event_id, phase, rnd)  # cut work on its lane: what a crash cut of its round
            self._run_phase(phase, event, names_self, outcome, cut, rnd)
        except Exception as exc:  # never lose the lane: log and go on with the event's next phase
            self.log.error("runner.internal_error", event_id=event.event_id, phase=phase, error=repr(exc),
                           exc_info=True)

    # --- running --------------------------------------------------------------------------

    def selected(self, phase: str, event: Event, names_self: bool) -> list[Handler]:
        """The handlers that run for this event in this phase, in order (narrowed by the profile in force)."""
        allowed = self.services.settings.handlers
        return [h for h in self.handlers if phase in h.spec.phases and h.spec.applies_to(event, names_self)
                and (allowed is None or h.spec.name in allowed)]

    def _run_phase(self, phase: str, event: Event, names_self: bool, outcome: str | None,
                   cut: threading.Event, rnd: int = 1) -> None:
        for handler, leaving in run_order(self.selected(phase, event, names_self), phase,
                                          lambda h: h.spec.dry_run or not self.dry_run):
            if self.stopping.is_set():
                return
            key = str(RunKey(handler.spec.name, phase, rnd))
            rec = self.store.result(event.event_id, key)
            if rec is not None and rec.get("outcome") != INTERRUPTED:
                continue
            if self.dry_run and not handler.spec.dry_run:
                self.log.info("handler.dry_run_skipped", event_id=event.event_id, handler=handler.spec.name,
                              phase=phase)
                continue
            if cut.is_set():
                self._finish(handler, phase, event, key, Result(SKIPPED, f"canceled: {why_cut(cut)} before it ran"),
                             0.0, self.clock.now())
                continue
            attempt = 1 if rec is None else attempt_of(rec) + 1  # an interrupted run goes again
            run = partial(self._run_one, handler, phase, event, names_self, outcome, key, cut, attempt, leaving)
            if not holds(handler.spec) and self._background.busy(event.event_id, handler.spec.name):  # an earlier run
                run = partial(self._background.submit, event.event_id, handler.spec.name, partial(run, background=True))
            run()

    def _run_one(self, handler: Handler, phase: str, event: Event, names_self: bool, outcome: str | None,
                 key: str, cut: threading.Event, attempt: int, leaving: bool, background: bool = False) -> None:
        spec, settings = handler.spec, self.services.settings
        now = self.clock.now()
        base = max(spec.timeout, handler.minimum_timeout(settings))
        allowed = budget(base, phase, event.not_before, now)
        fields = {"event_id": event.event_id, "event_type": event.event_type, "handler": spec.name, "phase": phase}
        if (short := short_budget(allowed, handler.wanted_timeout(settings, base))) is not None:
            self.metrics.deadline_short.inc()
            self.log.warning("deadline.short", **fields, **short)
        if allowed <= 0:
            self._finish(handler, phase, event, key, Result(SKIPPED, "deadline: too close to NotBefore to start"),
                         0.0, now)
            return
        record = RunRecord(outcome=RUNNING, started_at=iso_z(now), attempt=attempt)
        self._record(event.event_id, key, {**record, "background": True} if background else record)
        self.log.info("handler.started", **fields, timeout=round(allowed, 1), attempt=attempt)
        ctx = Context(event=event, phase=phase, vm_name=settings.vm_name, names_self=names_self, timeout=allowed,
                      deadline=event.not_before, dry_run=self.dry_run, clock=self.clock, cancel=cut,
                      stopping=self.stopping, settings=settings, outcome=outcome, attempt=attempt,
                      leaving_rotation=leaving)
        t0 = self.clock.monotonic()
        cuttable = phase != PHASE_COMPLETED and not background
        if cuttable:
            with self._lock:
                self._running[event.event_id] = spec.name
        try:
            run = RunThread(handler, ctx)
            end = partial(self._end, handler, phase, event, key, run, ctx, allowed, t0, now)
            if background or holds(spec) or run.returns_within(self.clock, FIRST_TRY):
                end()
                return
        finally:
            if cuttable:
                with self._lock:
                    self._running.pop(event.event_id, None)
        # a non-holding run past its first try: it goes on in the background, the phase goes on now
        handed = self._background.hand_over(event.event_id, spec.name, end)
        self._record(event.event_id, key, {**record, "background": True})
        self.log.info("handler.background", **fields, first_try=FIRST_TRY, budget_left=round(allowed - FIRST_TRY, 1),
                      reason="on_failure: continue: the run goes on in the background; the phase goes on")
        if self.on_result:
            self.on_result(event.event_id, spec.name, phase, Result(RUNNING, "goes on in the background"))
        handed()

    def _end(self, handler: Handler, phase: str, event: Event, key: str, run: RunThread, ctx: Context,
             allowed: float, t0: float, now: datetime) -> None:
        """Wait for the run within its budget (a hung handler gets 5 s more), then record what it came to."""
        got = run.result(allowed + 5.0 - (self.clock.monotonic() - t0))
        result = run_result(got, ctx.event_gone, self.stopping.is_set(), allowed, why_cut(ctx.cancel))
        if result is None:
            self.log.warning("handler.abandoned", event_id=event.event_id, handler=handler.spec.name, phase=phase,
                             reason="maintd is stopping; the run will be settled at restart")
            return
        self._finish(handler, phase, event, key, result, self.clock.monotonic() - t0, now)

    def _finish(self, handler: Handler, phase: str, event: Event, key: str, result: Result, duration: float,
                started: datetime) -> None:
        spec = handler.spec
        record = finished_record(result, spec.on_failure, duration, iso_z(started), iso_z(self.clock.now()),
                                 self.store.result(event.event_id, key))
        self._record(event.event_id, key, record, journal="handler.finished")
        self.metrics.handler_runs.labels(spec.name, phase, result.outcome).inc()
        self.metrics.handler_duration.labels(spec.name, phase).observe(duration)
        level = "info" if result.outcome in (OK, SKIPPED) else "warning" if result.outcome == CANCELED else "error"
        getattr(self.log, level)("handler.finished", event_id=event.event_id, event_type=event.event_type,
                                 handler=spec.name, phase=phase, outcome=result.outcome, detail=result.detail,
                                 exit_code=result.exit_code, duration_seconds=round(duration, 3))
        if self.on_result:
            self.on_result(event.event_id, spec.name, phase, result)

    def _record(self, event_id: str, key: str, value: RunRecord | dict[str, Any], journal: str | None = None) -> None:
        with kept_in_memory():
            self.store.record(event_id, key, value, journal=journal)

    # --- lifecycle ------------------------------------------------------------------------

    def wait_idle(self, timeout: float) -> bool:
        """Block until no event has queued or running work, in the background too (tests, shutdown)."""
        end = self.clock.monotonic() + timeout
        return self._lanes.wait_idle(timeout) and self._background.wait_idle(max(0.0, end - self.clock.monotonic()))

    def stop(self, grace: float) -> None:
        """Let running handlers finish for up to `grace` seconds, then cut them short."""
        if not self.wait_idle(grace):
            self.log.warning("runner.cancelling", running=sorted(map(str, self._lanes.busy())))
        self.stopping.set()
        with self._lock:
            cuts = list(self._cuts.values())
        for cut in cuts:
            cut.set()
        self._lanes.shutdown()
        self._background.shutdown()
