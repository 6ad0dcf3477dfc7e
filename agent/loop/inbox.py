"""What other threads hand the loop: the one way up.

A handler thread that finished a run, and a peer answer, the store, the budget or the approver that
has news for the coordinator, only put an item here and wake the loop's sleep: no lock of the loop's
is taken and nothing the loop owns is read. The loop takes everything at the top of its next pass and
decides there, on its own thread, with that pass's `Tick` (a VM that just became ready is
coordinated at once, without waiting for the next poll).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from agent.clock import Sleeper
from agent.handlers.base import Result


@dataclass(frozen=True)
class Finished:
    """A handler run that finished, as its thread hands it to the loop (recorded in the state store already)."""

    event_id: str
    handler: str
    phase: str
    result: Result


@dataclass(frozen=True)
class Taken:
    """What the loop took in one go: the runs that finished, and whether coordination's inputs changed."""

    finished: tuple[Finished, ...]
    changed: bool


class Inbox:
    """A queue any thread puts to and only the loop takes from, and the loop's sleep it wakes."""

    def __init__(self, sleeper: Sleeper) -> None:
        self._queue: queue.SimpleQueue[Finished | None] = queue.SimpleQueue()
        """Finished runs; None: coordination's inputs changed."""
        self._sleeper = sleeper

    def handler_finished(self, event_id: str, handler: str, phase: str, result: Result) -> None:
        """A handler thread: this run finished (any thread; only enqueues and wakes)."""
        self._queue.put(Finished(event_id, handler, phase, result))
        self._sleeper.wake()

    def coordination_changed(self) -> None:
        """A peer, the store, the budget or the approver has news: decide about approvals again soon (any thread)."""
        self._queue.put(None)
        self._sleeper.wake()

    def waiting(self) -> bool:
        """Whether something waits to be taken (the loop does not sleep then)."""
        return not self._queue.empty()

    def take(self) -> Taken:
        """Everything put so far (the loop's thread)."""
        finished: list[Finished] = []
        changed = False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return Taken(tuple(finished), changed)
            if item is None:
                changed = True
            else:
                finished.append(item)
