"""This VM's compute identity from IMDS: asked on a thread of its own for the loop, or on the caller's.

The loop never waits on the compute call (up to 10 s per try, retried): it starts a lookup, ticks on, and takes
the result on a later pass (decision 0018); `maintd run --once` asks on its own thread. One lookup at a time; a
stop cuts its retries short, a reload drops a lookup under way (it answers for the old config).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from agent.clock import Clock, Waitable
from agent.errors import ImdsError
from agent.health.health_store import HealthState, HealthStore
from agent.imds.imds_client import is_transient
from agent.model.identity import Identity
from agent.retry import retrying as retrying_on
from agent.telemetry import logs

Lookup = concurrent.futures.Future[Identity | None]
"""A lookup's result: this VM's identity, or None when IMDS could not tell."""


class IdentityLookup:
    """Asks IMDS who this VM is (`compute`: the IMDS client in force) and reports it (health `imds/identity`)."""

    def __init__(self, clock: Clock, health: HealthStore, compute: Callable[[], Identity],
                 max_backoff: Callable[[], float]) -> None:
        self.clock = clock
        self.health = health
        self.compute = compute
        self.max_backoff = max_backoff
        self._stopping = threading.Event()  # cuts a lookup's retries short at stop
        self._lookup: Lookup | None = None

    def ask(self, attempts: int, cancel: Waitable) -> Identity | None:
        """Ask IMDS for this VM's compute identity (tenacity on the injected clock); None, reported, when IMDS
        cannot tell. Takes up to `attempts` compute calls of up to 10 s: never on the loop's thread."""
        retrying = retrying_on(self.clock, retry_if=is_transient, attempts=attempts, cancel=cancel,
                               maximum=min(10.0, self.max_backoff()))
        log = logs.get("daemon")
        try:
            identity: Identity = retrying(self.compute)
        except ImdsError as exc:
            log.error("identity.failed", error=str(exc), body=exc.body[:200] or None,
                      hint="set identity.name in the config if IMDS compute metadata is not available")
            self.health.set("imds", "identity", HealthState.ERROR, f"cannot learn this VM's name from IMDS: {exc}")
            return None
        log.info("identity.resolved", vm_name=identity.name, computer_name=identity.computer_name or None,
                 scale_set=identity.scale_set or None)
        self.health.set("imds", "identity", HealthState.OK, f"this VM is {identity.name}")
        return identity

    def start(self, attempts: int) -> None:
        """Start asking on a thread of its own, unless a lookup runs already (a daemon thread: a compute call under
        way never holds up the exit)."""
        if self._lookup is None:
            self._lookup = concurrent.futures.Future()
            threading.Thread(target=self._look_up, args=(self._lookup, attempts), name="identity", daemon=True).start()

    def _look_up(self, lookup: Lookup, attempts: int) -> None:
        try:
            lookup.set_result(self.ask(attempts, self._stopping))
        finally:
            if not lookup.done():  # a bug in the lookup (logged by the thread's excepthook): the loop asks again
                lookup.set_result(None)

    def take(self) -> Lookup | None:
        """On the loop: the lookup that finished (done with it: the next `start` asks again), None while none has."""
        lookup = self._lookup
        if lookup is None or not lookup.done():
            return None
        self._lookup = None
        return lookup

    def drop(self) -> None:
        """Forget a lookup under way (a reload changed the identity config: its result is not taken)."""
        self._lookup = None

    def stop(self) -> None:
        """Cut a lookup's retries short (maintd is stopping)."""
        self._stopping.set()
