"""The keeper: one thread that calls `Handler.keep` for work that lasts while maintenance lasts (an
Alertmanager silence extended, recreated when deleted, expired once the VM is back in rotation).

It reads the runner's handlers at each step, so a reload's new handler objects are the ones kept
(their state lives in the store's notes, not in the objects), and runs when maintd starts (a restart
mid-event picks the work up), after each handler run, and when a handler's `keep` asked to be called
again. It starts with the first handler that keeps anything and sleeps while none has work: no
thread and no wake-ups for a config without such handlers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from agent.clock import Clock
from agent.handlers.base import Handler
from agent.telemetry import logs

RETRY_AFTER_ERROR = 30.0
"""Seconds before a `keep` that raised is called again."""


def keeps(handler: Handler) -> bool:
    """Whether the handler's type has work to keep (it overrides `keep`)."""
    return type(handler).keep is not Handler.keep


class Keeper:
    """Calls `keep` on the handlers that have it, on one thread of its own; thread-safe."""

    def __init__(self, handlers: Callable[[], list[Handler]], clock: Clock) -> None:
        self.handlers = handlers
        self.clock = clock
        self.log = logs.get("keeper")
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def step(self) -> float | None:
        """Call each keeping handler once; the seconds until the soonest wants to be called again (None: never)."""
        waits: list[float] = []
        for handler in self.handlers():
            if not keeps(handler):
                continue
            try:
                wait = handler.keep()
            except Exception as exc:  # a bug in one handler's keep must not end the thread
                self.log.error("keeper.internal_error", handler=handler.spec.name, error=repr(exc), exc_info=True)
                wait = RETRY_AFTER_ERROR
            if wait is not None:
                waits.append(max(0.05, wait))
        return min(waits, default=None)

    def wake(self) -> None:
        """Run a step soon (a handler ran, maintd started): starts the thread if a handler keeps work."""
        with self._lock:
            if self._thread is None and not self._stop.is_set() and any(keeps(h) for h in self.handlers()):
                self._thread = threading.Thread(target=self._run, name="keeper", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            wait = self.step()
            if self._stop.is_set():
                return
            if wait is None:
                self._wake.wait()
            else:
                self.clock.wait(self._wake, wait)

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (a step under way finishes its request first, up to `timeout`)."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
