"""B6, a Retry-After ends with the fault: how much of it an event can afford, and whether the store answered
since a path was told to wait.

A path honours the store's Retry-After for at most RETRY_AFTER_CAP_S and never past RETRY_AFTER_SHARE of the time
left to the event's NotBefore (`affordable_wait`, pure): a store that asks for a day must not cost the event its
early approval.

Every path to the store (the exchange's markers and listings, the approver's claim, the budget, the fleet
history) goes through the one client `SharedClient` opens, wrapped here: each request that returns (an
answer, a condition that did not hold and absence included) moves `Answers.count` on. A path the store asked to
wait (a 503/429 with Retry-After) keeps PROBE_EVERY_S of it (all of a shorter one: the request the store asked to
wait is never sent again sooner), then notes the count, and its wait ends as soon as the count moved: the first
request that succeeds after that, by any path, ends every wait a Retry-After set. A failure (`StoreError`, any
other exception) moves nothing. So that a wait ends with the fault even when no other path is asking, the exchange
reads the event's own marker every PROBE_EVERY_S while the wait lasts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Protocol, TypeVar

from agent.coordination.store.store_protocol import Item, StoreError, Unchanged, retry_delay

T = TypeVar("T")


class Store(Protocol):
    """What every store path needs of `blob_store.BlobStore` (a fake in tests)."""

    def put(self, name: str, metadata: Mapping[str, str]) -> str | None: ...
    def list_folder(self, prefix: str) -> tuple[list[Item], datetime]: ...
    def create(self, name: str, metadata: Mapping[str, str]) -> str | None: ...
    def replace(self, name: str, metadata: Mapping[str, str], etag: str) -> str | None: ...
    def read(self, name: str) -> tuple[dict[str, str], str] | None: ...
    def read_body(self, name: str) -> tuple[bytes, str, datetime] | None: ...
    def read_if_changed(self, name: str, etag: str) -> tuple[bytes, str, datetime] | Unchanged | None: ...
    def write_body(self, name: str, body: bytes, etag: str | None) -> str | None: ...
    def close(self) -> None: ...

RETRY_AFTER_CAP_S, RETRY_AFTER_SHARE = 30.0, 0.25
"""B6: a path honours a Retry-After for at most this long, and never past this share of the time left to NotBefore."""
PROBE_EVERY_S = 5.0
"""While a Retry-After holds an event's requests back, one cheap read (its own marker) this often asks whether the
fault is over (a read of another path: the request the store asked to wait is not sent again before its time)."""


def affordable_wait(retry_after: float | None, time_left: float | None) -> float:
    """The seconds of the store's Retry-After an event can afford to wait (0: none asked); `time_left`: seconds to
    its NotBefore (None: none known, only the cap)."""
    if not retry_after or retry_after <= 0:
        return 0.0
    cap = RETRY_AFTER_CAP_S if time_left is None else min(RETRY_AFTER_CAP_S, max(0.0, time_left) * RETRY_AFTER_SHARE)
    return min(retry_after, cap)


class Answers:
    """Requests the store answered, by any path (thread-safe)."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def note(self) -> None:
        with self._lock:
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def since(self, mark: int | None) -> bool:
        """Whether the store answered anything after `mark` (a `count` read when a path was told to wait)."""
        return mark is not None and self._count > mark


class RetryWait:
    """One path's wait after a failure (the budget's): the backoff, or a Retry-After as far as the event affords,
    which ends at the first answer the store gives any path once PROBE_EVERY_S of it passed (`ended`)."""

    def __init__(self, answers: Answers | None) -> None:
        self.answers = answers
        self.early_from = float("inf")
        self.mark: int | None = None

    def after_failure(self, error: StoreError, failures: int, time_left: float | None, now: float) -> float:
        asked = affordable_wait(error.retry_after, time_left)
        self.early_from = now + min(asked, PROBE_EVERY_S) if asked and self.answers is not None else float("inf")
        self.mark = None
        return max(retry_delay(failures), asked)

    def ended(self, now: float) -> bool:
        """Whether the store answered another path since PROBE_EVERY_S of a Retry-After's wait passed."""
        if self.answers is None or now < self.early_from:
            return False
        if self.mark is None:
            self.mark = self.answers.count  # the answers from now on end it
            return False
        if not self.answers.since(self.mark):
            return False
        self.early_from, self.mark = float("inf"), None
        return True


class SharedClient:
    """The one store client every path shares (the exchange's requests, the claim, the budget, the history), opened
    on first use by whichever worker asks first (the token and the SDK's import cost land there), its answers
    counted in `answers`."""

    def __init__(self, open_store: Callable[[], Store]) -> None:
        self.open_store = open_store
        self.answers = Answers()
        self._store: Store | None = None
        self._lock = threading.Lock()

    def get(self) -> Store:
        """The client, opened now if it is not yet (a failure to open is a `StoreError`, and the next call tries
        again)."""
        with self._lock:
            if self._store is None:
                try:
                    self._store = AnsweredStore(self.open_store(), self.answers)
                except StoreError:
                    raise
                except Exception as exc:  # an SDK that cannot even build its client is a store failure like any other
                    raise StoreError("error", f"cannot open the store: {str(exc)[:300]}") from None
            return self._store

    def close(self) -> None:
        """Close the client, if it was opened."""
        with self._lock:
            if self._store is not None:
                self._store.close()


class AnsweredStore:
    """A `Store` that notes each answer in `answers` (every call is passed through unchanged)."""

    def __init__(self, store: Store, answers: Answers) -> None:
        self.inner, self.answers = store, answers

    def _answered(self, call: Callable[[], T]) -> T:
        result = call()
        self.answers.note()
        return result

    def put(self, name: str, metadata: Mapping[str, str]) -> str | None:
        return self._answered(lambda: self.inner.put(name, metadata))

    def list_folder(self, prefix: str) -> tuple[list[Item], datetime]:
        return self._answered(lambda: self.inner.list_folder(prefix))

    def create(self, name: str, metadata: Mapping[str, str]) -> str | None:
        return self._answered(lambda: self.inner.create(name, metadata))

    def replace(self, name: str, metadata: Mapping[str, str], etag: str) -> str | None:
        return self._answered(lambda: self.inner.replace(name, metadata, etag))

    def read(self, name: str) -> tuple[dict[str, str], str] | None:
        return self._answered(lambda: self.inner.read(name))

    def read_body(self, name: str) -> tuple[bytes, str, datetime] | None:
        return self._answered(lambda: self.inner.read_body(name))

    def read_if_changed(self, name: str, etag: str) -> tuple[bytes, str, datetime] | Unchanged | None:
        return self._answered(lambda: self.inner.read_if_changed(name, etag))

    def write_body(self, name: str, body: bytes, etag: str | None) -> str | None:
        return self._answered(lambda: self.inner.write_body(name, body, etag))

    def close(self) -> None:
        self.inner.close()
