"""tenacity retries that run on maintd's injected clock.

tenacity measures `stop_after_delay` with the real monotonic clock, so a test clock that jumps
would never end the retries; here the stop and the sleeps both go through `Clock`. The wait is
exponential with additive jitter, built from primitives every tenacity since 8.x has.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import tenacity

from agent.clock import Clock, Waitable


def retrying(clock: Clock, *, retry_if: Callable[[BaseException], bool], attempts: int | None = None,
             within: float | None = None, cancel: Waitable | None = None, initial: float = 0.5,
             maximum: float = 5.0) -> tenacity.Retrying:
    """A Retrying that gives up after `attempts` tries, when `cancel` is set, or rather than start an
    attempt after `within` seconds of `clock`: it does not sleep past the deadline to try once more, and
    checks the deadline again right before each attempt, so a sleep that overran it (a paused process, a
    frozen VM) ends the retries with the last attempt's exception instead of one more try."""
    start = clock.monotonic()
    stop_event = cancel or threading.Event()
    backoff = tenacity.wait_exponential(multiplier=initial, max=maximum) + tenacity.wait_random(0, initial)
    planned: dict[int, float] = {}
    last: list[BaseException] = []

    def pause(state: Any) -> float:
        """The wait after this attempt, drawn once (tenacity asks stop and wait in either order)."""
        if state.attempt_number not in planned:
            planned.clear()
            planned[state.attempt_number] = backoff(state)
        return planned[state.attempt_number]

    def before(state: Any) -> None:
        """Right before an attempt: one after the first never starts past the deadline."""
        if last and within is not None and clock.monotonic() - start >= within:
            raise last[-1]

    def stop(state: Any) -> bool:
        failure = state.outcome.exception() if state.outcome is not None else None
        last[:] = [failure] if failure is not None else []
        if stop_event.is_set():
            return True
        if attempts is not None and state.attempt_number >= attempts:
            return True
        return within is not None and clock.monotonic() + pause(state) - start >= within

    return tenacity.Retrying(
        stop=stop,
        before=before,
        wait=pause,
        retry=tenacity.retry_if_exception(retry_if),
        sleep=lambda seconds: None if clock.wait(stop_event, seconds) else None,
        reraise=True,
    )
