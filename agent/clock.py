"""Time as a parameter: the daemon reads time only through a Clock, so tests run scenarios without sleeping."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...

    def sleep(self, seconds: float) -> None: ...

    def wait(self, event: threading.Event, seconds: float) -> bool: ...


class SystemClock:
    """The real clock. `sleep` is interruptible through `wake()` (a SIGTERM cuts a wait short)."""

    def __init__(self) -> None:
        self._wake = threading.Event()

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._wake.wait(seconds)
        self._wake.clear()

    def wake(self) -> None:
        self._wake.set()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Wait up to `seconds` for `event` (worker threads: a drain wait cut short by a stop)."""
        return event.wait(max(0.0, seconds))


class FakeClock:
    """A clock tests move by hand; `sleep` advances it instantly."""

    def __init__(self, start: datetime | None = None, monotonic: float = 1000.0) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=timezone.utc)
        self._mono = monotonic
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    def advance(self, seconds: float) -> None:
        from datetime import timedelta

        with self._lock:
            self._mono += seconds
            self._now += timedelta(seconds=seconds)

    def wake(self) -> None:
        """Nothing to wake: FakeClock never blocks."""

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Advance the clock by `seconds` unless `event` is already set."""
        if not event.is_set():
            self.advance(max(0.0, seconds))
        return event.is_set()
