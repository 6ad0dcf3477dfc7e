"""Handler phases and run outcomes: the names the runner records, handlers return, metrics count
and the views show — defined once, importing nothing."""

from __future__ import annotations

PHASES = ("scheduled", "started", "completed")
OK, FAILED, TIMED_OUT, SKIPPED, CANCELED = "ok", "failed", "timed_out", "skipped", "canceled"
OUTCOMES = (OK, FAILED, TIMED_OUT, SKIPPED, CANCELED)
"""Final outcomes of a run (`canceled`: cut short because its event left the document)."""
RUNNING, INTERRUPTED = "running", "interrupted"
"""Records that are not final: a run under way, and one a crash cut short that will run again."""
