"""What this VM's run records say of an event: whether it is ready, why not, and whether its work is done.

The runner runs handlers and records each run (`run_records`); `Readiness` only reads those records, for the
handlers the runner would run (its selection: the profile's narrowing, dry-run). The loop asks it once per pass
for each event's pending handlers (the `Tick`), the API for the words of `not_ready`, the fleet history whether a
gone event has ended for this VM and was prepared in time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent.handlers.base import Handler
from agent.model.events import Event
from agent.model.outcomes import PHASE_COMPLETED, PHASE_SCHEDULED, RUNNING
from agent.model.tracker import Tracked
from agent.prepare.run_records import RunKey, blocks, round_of, why_not_ready
from agent.state.state_store import Store

if TYPE_CHECKING:
    from agent.prepare.handler_runner import Runner

Selected = Callable[[str, Event, bool], list[Handler]]
"""The handlers that run for an event in a phase, in order (the runner's `selected`)."""


class Readiness:
    """Reads the run records of the handlers `selected` picks (`dry_run`: the runner's, in force); thread-safe."""

    def __init__(self, store: Store, selected: Selected, dry_run: Callable[[], bool]) -> None:
        self.store = store
        self.selected = selected
        self.dry_run = dry_run

    @classmethod
    def of(cls, runner: Runner) -> Readiness:
        """The readiness of what `runner` runs."""
        return cls(runner.store, runner.selected, lambda: runner.dry_run)

    def _blocking(self, event: Event, names_self: bool) -> list[tuple[Handler, dict[str, Any] | None]]:
        if self.dry_run():
            return []
        out, rnd = [], round_of(self.store.results(event.event_id))
        for handler in self.selected(PHASE_SCHEDULED, event, names_self):
            rec = self.store.result(event.event_id, str(RunKey(handler.spec.name, PHASE_SCHEDULED, rnd)))
            if blocks(rec, handler.spec.on_failure):
                out.append((handler, rec))
        return out

    def pending(self, t: Tracked) -> list[str]:
        """Scheduled-phase handlers that keep the VM from being ready for this event."""
        return [h.spec.name for h, _ in self._blocking(t.event, t.names_self)]

    def not_ready(self, t: Tracked) -> list[str]:
        """Why the VM is not ready for this event, one sentence per handler, saying what to do."""
        return [why_not_ready(h.spec.name, rec, h.spec.max_attempts, t.event.event_id)
                for h, rec in self._blocking(t.event, t.names_self)]

    def is_ready(self, t: Tracked) -> bool:
        """Every scheduled handler finished ok (or failed under on_failure: continue)."""
        return not self.pending(t)

    def prepared(self, event: Event, names_self: bool) -> bool:
        """Whether this VM got ready for the event (every scheduled handler settled; also once it has gone)."""
        return not self._blocking(event, names_self)

    def finished(self, event: Event, names_self: bool) -> bool:
        """Whether a gone event's work is all done: no run of it running, and every `completed` handler that runs
        for it has its result (the undrain, say): the event has ended for this VM. (An interrupted run that will not
        run again keeps its `interrupted` record for good: it counts as done.)"""
        results = self.store.results(event.event_id)
        if any(r.get("outcome") == RUNNING for k, r in results.items() if RunKey.parse(k)):
            return False
        dry_run = self.dry_run()
        return all(str(RunKey(h.spec.name, PHASE_COMPLETED, round_of(results))) in results
                   for h in self.selected(PHASE_COMPLETED, event, names_self) if h.spec.dry_run or not dry_run)
