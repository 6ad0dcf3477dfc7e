"""When the next poll is due (pure): on its deadline while polls succeed, backing off while they fail.

Deadlines advance by the interval (`next_poll += interval`), so 3600 polls take 3600 s ± one
interval however long each answer took; a loop that fell behind (a suspend, a slow call) polls
once, not a burst of catch-up polls.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


def next_poll_delay(failures: int, interval: float, max_backoff: float, retry_after: float | None,
                    rand: Callable[[], float] = random.random) -> float:
    """Delay before the next poll after `failures` failed polls in a row (0 = the normal cadence).

    Exponential (interval × 2^(failures-1)) with ±25 % jitter, capped at `max_backoff` but never
    below the interval; a Retry-After from IMDS is honoured even beyond the cap.
    """
    if failures <= 0:
        return interval
    base = min(max_backoff, interval * (2.0 ** min(failures - 1, 30)))
    delay = max(interval, base * (0.75 + 0.5 * rand()))
    delay = min(delay, max(max_backoff, interval))
    if retry_after is not None:
        delay = max(delay, retry_after)
    return delay


@dataclass
class Cadence:
    """The poll schedule and its record: next deadline, failures in a row, polls, last success."""

    next_poll: float
    started_at: float
    failures: int = 0
    polls: int = 0
    last_success: float | None = None

    def failed(self, now: float, interval: float, max_backoff: float, retry_after: float | None = None) -> None:
        """A poll failed (or could not be made) at `now`: back off."""
        self.failures += 1
        self.next_poll = now + next_poll_delay(self.failures, interval, max_backoff, retry_after)

    def succeeded(self, now: float, interval: float) -> None:
        """A poll succeeded; it finished at `now`."""
        self.failures = 0
        self.polls += 1
        self.last_success = now
        self.next_poll += interval
        if self.next_poll < now - interval:
            self.next_poll = now
