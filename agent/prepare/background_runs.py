"""Where a handler's run happens, and the runs that go on in the background.

`RunThread`: one run on a thread of its own, so a hung handler costs its budget, not the lane's worker.
`BackgroundRuns`: the runs of non-holding handlers that went on past their first try (see
`run_order`), each finished on a lane of its own per (event, handler): two runs of one handler for
one event never overlap (a later phase's run of it waits for the earlier one, in the background
too), and the runner's `wait_idle` and `stop` see them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from agent.clock import Clock
from agent.handlers.base import Context, Handler, Result
from agent.lanes import Job, Lanes
from agent.model.outcomes import FAILED


class RunThread:
    """A handler's `run(ctx)` started on a thread of its own; an exception is a failed result."""

    def __init__(self, handler: Handler, ctx: Context) -> None:
        self._handler, self._ctx = handler, ctx
        self._box: list[Result] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._target, name=f"h-{handler.spec.name}", daemon=True)
        self._thread.start()

    def _target(self) -> None:
        try:
            self._box.append(self._handler.run(self._ctx))
        except Exception as exc:
            self._box.append(Result(FAILED, f"{type(exc).__name__}: {exc}"))
        finally:
            self._done.set()

    def returns_within(self, clock: Clock, seconds: float) -> bool:
        """Wait up to `seconds` on `clock` for the run to return; whether it did."""
        return clock.wait(self._done, seconds) or self._done.is_set()

    def result(self, seconds: float) -> Result | None:
        """The run's result, waiting up to `seconds` for it; None when it has not returned."""
        self._thread.join(max(0.0, seconds))
        return self._box[0] if self._box else None


class BackgroundRuns:
    """Lanes per (EventId, handler name) for the runs that go on in the background; thread-safe."""

    def __init__(self, max_workers: int) -> None:
        self._lanes = Lanes(max_workers, "handler-background")

    def busy(self, event_id: str, handler: str) -> bool:
        """Whether a run of the handler for the event goes on in the background (or waits to)."""
        return (event_id, handler) in self._lanes.busy()

    def names(self, event_id: str) -> list[str]:
        """The handlers with a run for the event in the background."""
        return sorted(str(key[1]) for key in self._lanes.busy() if isinstance(key, tuple) and key[0] == event_id)

    def submit(self, event_id: str, handler: str, job: Job) -> None:
        """Run `job` after the handler's background work for the event (at once when there is none)."""
        self._lanes.submit((event_id, handler), job)

    def hand_over(self, event_id: str, handler: str, job: Job) -> Callable[[], None]:
        """Queue `job` like `submit`, held until the returned function is called (the handler's lane is busy from
        now, so a cut sees the run, and the job starts only once the runner has recorded the hand-over)."""
        handed = threading.Event()

        def held() -> None:
            handed.wait()
            job()

        self.submit(event_id, handler, held)
        return handed.set

    def wait_idle(self, timeout: float) -> bool:
        return self._lanes.wait_idle(timeout)

    def shutdown(self) -> None:
        self._lanes.shutdown()
