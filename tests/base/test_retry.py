"""Retries on the injected clock: they stop at the deadline instead of sleeping past it."""

import pytest

from agent.retry import retrying


class Flaky(Exception):
    pass


def always_failing(clock, log):
    def call():
        log.append(clock.monotonic())
        raise Flaky()
    return call


def test_no_attempt_starts_after_the_deadline(clock):
    tries: list[float] = []
    r = retrying(clock, retry_if=lambda e: isinstance(e, Flaky), within=10.0, initial=1.0, maximum=4.0)
    start = clock.monotonic()
    with pytest.raises(Flaky):
        r(always_failing(clock, tries))
    assert len(tries) >= 3
    assert all(t - start < 10.0 for t in tries)
    assert clock.monotonic() - start < 10.0, "gave up without sleeping past the deadline"


def test_attempts_bound_the_tries(clock):
    tries: list[float] = []
    with pytest.raises(Flaky):
        retrying(clock, retry_if=lambda e: isinstance(e, Flaky), attempts=3)(always_failing(clock, tries))
    assert len(tries) == 3


def test_a_success_after_failures_is_returned(clock):
    answers = iter([Flaky(), Flaky(), "ok"])

    def call():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert retrying(clock, retry_if=lambda e: isinstance(e, Flaky), within=60.0)(call) == "ok"


class Pausing:
    """The injected clock, with a sleep that overruns by `extra` seconds (a SIGSTOP, a frozen VM)."""

    def __init__(self, clock, extra: float) -> None:
        self.clock, self.extra = clock, extra

    def monotonic(self) -> float:
        return self.clock.monotonic()

    def wait(self, event, seconds: float) -> bool:
        self.clock.advance(seconds + self.extra)
        return event.is_set()


def test_a_sleep_that_overran_the_deadline_starts_no_attempt(clock):
    """The deadline is checked right before each attempt, not only before a sleep: paused for 100 s in
    its backoff, the retrying gives up with the last failure instead of trying once more."""
    tries: list[float] = []
    r = retrying(Pausing(clock, 100.0), retry_if=lambda e: isinstance(e, Flaky), within=10.0, initial=1.0)
    start = clock.monotonic()
    with pytest.raises(Flaky):
        r(always_failing(clock, tries))
    assert tries == [start]
