"""The keeper: no thread for handlers that keep nothing; `keep` called when woken and again when it asks,
on the handlers in force (a reload's new objects); a `keep` that raises is logged and called again."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from agent.clock import SystemClock
from agent.handlers.base import Handler, HandlerSpec
from agent.handlers.drain import DrainHandler
from agent.prepare.keeper import Keeper
from tests.e2e.harness import wait_until


class Keeping(Handler):
    type_name = "keeping"

    def __init__(self, answers: list[float | None | Exception]) -> None:
        super().__init__(HandlerSpec(name="k", type="keeping", phases=("scheduled",)), SimpleNamespace())
        self.answers = answers
        self.calls = 0
        self.done = threading.Event()

    def keep(self) -> float | None:
        self.calls += 1
        answer = self.answers.pop(0) if self.answers else None
        if not self.answers:
            self.done.set()
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_handlers_that_keep_nothing_get_no_thread():
    drain = DrainHandler(HandlerSpec(name="drain", type="drain", phases=("scheduled",)), SimpleNamespace())
    keeper = Keeper(lambda: [drain], SystemClock())
    before = threading.active_count()
    keeper.wake()
    assert threading.active_count() == before
    assert keeper.step() is None
    keeper.stop()


def test_keep_is_called_again_when_it_asks_and_after_an_error_and_the_current_handlers_are_read(logs):
    first = Keeping([0.01, 0.01, None])
    handlers = [first]
    keeper = Keeper(lambda: handlers, SystemClock())
    keeper.wake()
    assert first.done.wait(5) and first.calls == 3, "called at the wake, then twice when it asked"

    replaced = Keeping([ValueError("bug"), None])
    handlers[:] = [replaced]  # a reload: the thread reads the handlers anew at every step
    keeper.wake()
    wait_until(lambda: replaced.calls == 1, 5, "the new handler's keep")
    keeper.wake()  # its next run: called again although the last keep raised
    assert replaced.done.wait(5) is True
    keeper.stop()
    assert [e["handler"] for e in logs if e["event"] == "keeper.internal_error"] == ["k"]
    assert first.calls == 3
