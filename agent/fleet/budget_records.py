"""B5, the places record is data, not instructions: odd records found, counted, reported and ignored; and the
record as this member last read it, for the conditional reads of B4.

An instant later than the store's Date plus FUTURE_BOUND_S cannot have been written by a member (every instant in
the record is a Date the store gave the writer): the entry, or the member's stamp, is an odd record. It is
ignored (a holder "renewed" in 2099 blocks nobody), the next write drops it, and it is a counted problem
(`maintd_budget_record_problems_total{problem}`, each odd record once), a Warning (`coordination`/
`budget_records`, kept WARN_FOR_S after the last one found) and a `budget.invalid_record` line at most once per
LOG_GAP_S. A record that is not a places record at all is one too (`unreadable`): it is never taken as free
places (the member waits as if the store were down).

`without_odd` is pure; `RecordProblems` is the reporting edge (the budget's worker calls it, thread-safe);
`LastRead` holds the body and ETag this member last read or wrote (its worker lane only), so the next read asks
If-None-Match and a 304 costs no body (`read_record`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, Protocol

from agent.coordination.store.store_protocol import Unchanged
from agent.fleet.budget_rules import Entry, Places
from agent.telemetry import logs

FUTURE_BOUND_S = 60.0
"""Seconds past the store's Date an instant in the record may be (the Date's resolution, a writer's slow answer)."""
FUTURE: Final = "future_instant"
UNREADABLE: Final = "unreadable"
PROBLEMS = (FUTURE, UNREADABLE)
"""The metric's `problem` label: bounded."""
LOG_GAP_S = 300.0
"""Seconds between two `budget.invalid_record` lines while the problems found stay the same."""
HEALTH = "budget_records"
WARN_FOR_S = 3600.0
"""Seconds the Warning stays after the last odd record was found (the next write drops it: the Warning must
outlive the record for an operator to see it)."""
SEEN_MAX = 1024


def without_odd(places: Places, now: datetime) -> tuple[Places, tuple[str, ...]]:
    """The record without its odd entries and member stamps (an instant later than `now`, the store's Date, plus
    FUTURE_BOUND_S), and a description of each one left out."""
    bound = now + timedelta(seconds=FUTURE_BOUND_S)

    def odd(e: Entry) -> bool:
        return e.since > bound or e.renewed > bound

    found = [f"{e.vm[:64]}: {'holder' if e in places.holders else 'waiter'} dated {max(e.since, e.renewed):%Y-%m-%d}"
             for e in (*places.holders, *places.waiting) if odd(e)]
    found += [f"{vm[:64]}: member stamp dated {at:%Y-%m-%d}" for vm, at in places.members.items() if at > bound]
    if not found:
        return places, ()
    return Places(tuple(h for h in places.holders if not odd(h)), tuple(w for w in places.waiting if not odd(w)),
                  {vm: at for vm, at in places.members.items() if at <= bound}), tuple(found)


class ConditionalStore(Protocol):
    def read_body(self, name: str) -> tuple[bytes, str, datetime] | None: ...
    def read_if_changed(self, name: str, etag: str) -> tuple[bytes, str, datetime] | Unchanged | None: ...


@dataclass
class LastRead:
    """The record's body at the ETag this member last saw (read or written); its worker lane's own."""

    body: bytes = b""
    etag: str | None = None

    def keep(self, body: bytes, etag: str | None) -> None:
        self.body, self.etag = body, etag


def read_record(store: ConditionalStore, name: str, last: LastRead | None) -> tuple[bytes, str, datetime] | None:
    """The record, its ETag and the store's Date: If-None-Match on the ETag last seen (a 304 answers with the body
    kept from before, at the new Date); a plain read when nothing was seen yet."""
    if last is None or last.etag is None:
        found = store.read_body(name)
    else:
        answer = store.read_if_changed(name, last.etag)
        found = (last.body, answer.etag, answer.date) if isinstance(answer, Unchanged) else answer
    if last is not None:
        last.keep(*(found[:2] if found is not None else (b"", None)))
    return found


class RecordProblems:
    """Counts, logs (throttled) and reports the odd records a step found; thread-safe."""

    def __init__(self, metrics: Any, health: Callable[[str, str, str], None], monotonic: Callable[[], float]) -> None:
        self.metrics, self.health, self.monotonic = metrics, health, monotonic
        self.log = logs.get("budget")
        self._lock = threading.Lock()
        self._seen: set[tuple[str, str]] = set()
        self._said: tuple[frozenset[str], float] = (frozenset(), float("-inf"))
        self._reported: bool | None = None
        self._last = float("-inf")
        self.counted = 0
        """Odd records counted since maintd started (each once: the metric's sum), for the fleet view."""

    def found(self, group: str | None, problem: str, details: tuple[str, ...]) -> None:
        """A step found these odd records (`details`, one per record; none: the record was as written)."""
        with self._lock:
            now = self.monotonic()
            if not details:
                if self._reported is not False and now - self._last >= WARN_FOR_S:
                    self.health(HEALTH, "ok", f"budget {group}: every entry of the places record is one a member "
                                              "could have written")
                    self._reported = False
                return
            for d in details:
                if (problem, d) not in self._seen:
                    if len(self._seen) >= SEEN_MAX:
                        self._seen.clear()
                    self._seen.add((problem, d))
                    self.metrics.budget_record_problems.labels(problem).inc()
                    self.counted += 1
            self._last, key = now, frozenset(details)
            if key != self._said[0] or now - self._said[1] >= LOG_GAP_S:
                self._said = (key, now)
                self.log.warning("budget.invalid_record", group=group, problem=problem, count=len(details),
                                 example=details[0], effect="ignored: counted as neither out nor waiting; the next "
                                                            "write drops it" if problem == FUTURE else
                                 "no place is taken on it: members wait, and prepare at their last safe moment")
            many = "s" if len(details) != 1 else ""
            self.health(HEALTH, "warning", f"budget {group}: {len(details)} odd record{many} ({problem}), e.g. "
                                           f"{details[0]}; ignored")
            self._reported = True
