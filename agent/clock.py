"""Time as a parameter: the daemon reads time only through a Clock, so tests run scenarios without sleeping.

Waking a sleeper never takes a lock: the loop's sleep is a self-pipe (`PipeSleeper`) that `wake()`
writes one byte to and `select` waits on, so a signal handler (which runs on the main thread between
any two bytecodes, also while that thread holds a lock) can wake it, and so can any thread. Each
sleeper has a wake of its own: no other sleeper can consume it.
"""

from __future__ import annotations

import os
import select
import threading
import time
import weakref
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Waitable(Protocol):
    """What `Clock.wait` waits for: a `threading.Event`, or a `SignalFlag`."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class Sleeper(Protocol):
    """One thread's sleep, cut short by its own `wake()` (signal-safe, callable from any thread)."""

    def sleep(self, seconds: float) -> None: ...

    def wake(self) -> None: ...

    def fileno(self) -> int: ...


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...

    def sleep(self, seconds: float) -> None: ...

    def wait(self, event: Waitable, seconds: float) -> bool: ...

    def sleeper(self) -> Sleeper: ...


class PipeSleeper:
    """A sleep `wake()` cuts short, through a self-pipe: waking is one `os.write`, no lock anywhere.

    `fileno()` is the pipe's write end, for `signal.set_wakeup_fd`: then every signal wakes it too.
    One thread sleeps on it (a wake is consumed by the sleep it ends)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()  # not select(): it fails on a descriptor over 1023, which a busy process reaches
        self._poll.register(self._read, select.POLLIN)
        weakref.finalize(self, _close_all, self._read, self._write)

    def fileno(self) -> int:
        return self._write

    def wake(self) -> None:
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: a wake is pending already

    def sleep(self, seconds: float) -> None:
        """Sleep up to `seconds`, less when woken (a wake that came before the call ends it at once)."""
        if seconds > 0:
            self._poll.poll(seconds * 1000)
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass


def _close_all(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


class SignalFlag:
    """A flag a signal handler may set: an attribute and a wake of `sleeper`, no lock anywhere (a
    `threading.Event` takes its lock in `set`, and the main thread may hold it when the handler runs).
    Only the sleeper's thread may `wait` on it."""

    def __init__(self, clock: Clock, sleeper: Sleeper) -> None:
        self._clock = clock
        self._sleeper = sleeper
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._sleeper.wake()

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep on the sleeper until set or `timeout` seconds have passed; whether it is set."""
        deadline = self._clock.monotonic() + (timeout if timeout is not None else float("inf"))
        while not self._set and (left := deadline - self._clock.monotonic()) > 0:
            self._sleeper.sleep(left)
        return self._set


class SystemClock:
    """The real clock. `sleep` is a plain pause (the IMDS rate limit's ≤ 0.25 s); the loop sleeps on a
    `sleeper()` of its own, which a stop, a reload or a signal cuts short."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def sleeper(self) -> Sleeper:
        return PipeSleeper()

    def wait(self, event: Waitable, seconds: float) -> bool:
        """Wait up to `seconds` for `event` (worker threads: a drain wait cut short by a stop)."""
        return event.wait(max(0.0, seconds))


class FakeClock:
    """A clock tests move by hand; `sleep` advances it instantly."""

    def __init__(self, start: datetime | None = None, monotonic: float = 1000.0) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
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

    def sleeper(self) -> Sleeper:
        return _FakeSleeper(self)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._mono += seconds
            self._now += timedelta(seconds=seconds)

    def wait(self, event: Waitable, seconds: float) -> bool:
        """Advance the clock by `seconds` unless `event` is already set."""
        if not event.is_set():
            self.advance(max(0.0, seconds))
        return event.is_set()


class _FakeSleeper:
    """A FakeClock's sleeper: sleeping advances the clock; there is nothing to wake and no wakeup fd."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock

    def sleep(self, seconds: float) -> None:
        self._clock.sleep(seconds)

    def wake(self) -> None:
        """Nothing to wake: a fake sleep never blocks."""

    def fileno(self) -> int:
        return -1
