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
    attempt after `within` seconds of `clock` (it does not sleep past the deadline to try once more)."""
    start = clock.monotonic()
    stop_event = cancel or threading.Event()
    backoff = tenacity.wait_exponential(multiplier=initial, max=maximum) + tenacity.wait_random(0, initial)
    planned: dict[int, float] = {}

    def pause(state: Any) -> float:
        """The wait after this attempt, drawn once (tenacity asks stop and wait in either order)."""
        if state.attempt_number not in planned:
            planned.clear()
            planned[state.attempt_number] = backoff(state)
        return planned[state.attempt_number]

    def stop(state: Any) -> bool:
        if stop_event.is_set():
            return True
        if attempts is not None and state.attempt_number >= attempts:
            return True
        return within is not None and clock.monotonic() + pause(state) - start >= within

    return tenacity.Retrying(
        stop=stop,
        wait=pause,
        retry=tenacity.retry_if_exception(retry_if),
        sleep=lambda seconds: None if clock.wait(stop_event, seconds) else None,
        reraise=True,
    )
