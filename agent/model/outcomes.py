"""Handler phases and run outcomes: the names the runner records, handlers return, metrics count
and the views show — defined once, importing nothing."""

from __future__ import annotations

from typing import Final, Literal

Phase = Literal["scheduled", "started", "completed"]
PHASE_SCHEDULED: Final = "scheduled"
PHASE_STARTED: Final = "started"
PHASE_COMPLETED: Final = "completed"
PHASES: tuple[Phase, ...] = (PHASE_SCHEDULED, PHASE_STARTED, PHASE_COMPLETED)
"""Handler phases: an event appeared Scheduled, turned Started, left the document."""
OK, FAILED, TIMED_OUT, SKIPPED, CANCELED = "ok", "failed", "timed_out", "skipped", "canceled"
OUTCOMES = (OK, FAILED, TIMED_OUT, SKIPPED, CANCELED)
"""Final outcomes of a run (`canceled`: cut short because its event left the document)."""
PlanPreparation = Literal["held", "started"]
"""A plan's `preparation` (/v1/events/{id}): held until its time (or by the budget), or started."""
PREPARATION_HELD: Final = "held"
PREPARATION_STARTED: Final = "started"
RUNNING, INTERRUPTED = "running", "interrupted"
"""Records that are not final: a run under way, and one a crash cut short that will run again."""
