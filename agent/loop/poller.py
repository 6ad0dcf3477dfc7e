"""The loop's poll of IMDS: when it is due, and the GET itself, once this VM's name is known.

A poll is due by `cadence` (deadlines advance by the interval; a failure backs off). Until this VM's name is known
the poll waits for the identity lookup that runs off the loop (`identity_lookup.py`): a lookup that could not tell
backs off like a failed poll, then another starts. The GET runs on the loop's own thread with one deadline for the
whole exchange (a stop interrupts it at once); only IMDS's slow first answer, longer than a watchdog interval,
waits on a thread of its own while the loop keeps pinging the systemd watchdog (`call_pinging`).
"""

from __future__ import annotations

from collections.abc import Callable

from agent.clock import Clock
from agent.errors import ImdsError
from agent.imds.imds_client import PollResult
from agent.loop.cadence import Cadence
from agent.loop.report import Reporter
from agent.loop.wiring import Parts
from agent.systemd import Notifier, call_pinging


class Poller:
    """The loop's IMDS poll: its cadence (failures, backoff, the last success), reported on each outcome."""

    def __init__(self, parts: Parts, clock: Clock, notifier: Notifier, report: Reporter, *,
                 alive: Callable[[], None], identity_known: Callable[[], None]) -> None:
        self.parts = parts
        self.clock = clock
        self.notifier = notifier
        self.report = report
        self.alive = alive
        """Called while a slow first answer is awaited: the loop is alive (its view is published again)."""
        self.identity_known = identity_known
        """Called on the loop when a lookup found this VM's name."""
        self.cadence = Cadence(next_poll=clock.monotonic(), started_at=clock.monotonic())

    def due(self, now: float) -> bool:
        return now >= self.cadence.next_poll

    def poll(self, now: float, named: bool) -> PollResult | None:
        """The poll, once this VM's name is known (`named`, or a lookup found it): IMDS's answer, or None (no name
        yet, or failed: backing off)."""
        imds = self.parts.config.imds
        if not named and not self._identity_arrived(now):
            return None
        try:
            result = self.fetch()
        except ImdsError as exc:
            self.cadence.failed(self.clock.monotonic(), imds.poll_interval, imds.max_backoff, exc.retry_after)
            self.report.poll_failed(exc, self.cadence.failures)
            return None
        self.cadence.succeeded(self.clock.monotonic(), imds.poll_interval)
        self.report.poll_succeeded()
        return result

    def _identity_arrived(self, now: float) -> bool:
        """Take the identity a lookup found off the loop; while none has, the poll waits (a failed lookup backs
        off like a failed poll, then another starts)."""
        imds = self.parts.config.imds
        taken = self.parts.take_identity()
        if taken:
            self.identity_known()
            return True
        if taken is False:
            self.cadence.failed(now, imds.poll_interval, imds.max_backoff)
        else:
            self.parts.identity_lookup.start(attempts=1)
            self.cadence.next_poll = now + imds.poll_interval
        return False

    def fetch(self) -> PollResult:
        """The GET on the loop's own thread (its deadline bounds it, a stop interrupts it); only IMDS's
        slow first answer waits on a thread of its own while the loop keeps pinging the watchdog."""
        imds = self.parts.imds
        return call_pinging(imds.get_document, self.notifier, self.clock.monotonic, imds.next_timeout, self.alive)
