"""An in-memory store with the blob store's conditional writes, and a group of budgets on one fake clock."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from agent.clock import FakeClock
from agent.coordination.coordination_settings import BudgetConfig
from agent.coordination.store.budget import Budget, Want
from agent.coordination.store.budget_rules import Entry
from agent.coordination.store.budget_wake import Hinter
from agent.coordination.store.store_protocol import StoreError
from agent.metrics import Metrics


class CasStore:
    """Bodies with ETags: create if absent, replace if at the ETag; the clock is the store's Date."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.blobs: dict[str, tuple[bytes, str]] = {}
        self.lock = threading.Lock()
        self.n = 0
        self.down = False
        self.requests = 0

    def _check(self) -> None:
        self.requests += 1
        if self.down:
            raise StoreError("unreachable", "store unreachable: connection refused")

    def read_body(self, name: str) -> tuple[bytes, str, datetime] | None:
        with self.lock:
            self._check()
            found = self.blobs.get(name)
            return None if found is None else (found[0], found[1], self.clock.now())

    def write_body(self, name: str, body: bytes, etag: str | None) -> str | None:
        with self.lock:
            self._check()
            found = self.blobs.get(name)
            if (etag is None and found is not None) or (etag is not None and (found is None or found[1] != etag)):
                return None
            self.n += 1
            self.blobs[name] = (body, f"e{self.n}")
            return f"e{self.n}"


class Health:
    def __init__(self) -> None:
        self.reports: dict[str, tuple[str, str]] = {}

    def __call__(self, prop: str, state: str, text: str) -> None:
        self.reports[prop] = (state, text)


class Hints:
    """Wake hints delivered in-process to the member at the URL (or lost): a `WakeSender`'s stand-in."""

    def __init__(self) -> None:
        self.budgets: dict[str, Budget] = {}
        self.lost = False
        self.sent: list[str] = []

    def send(self, group: str, targets: Sequence[Entry]) -> None:
        for t in targets:
            self.sent.append(t.vm)
            if not self.lost and t.url in self.budgets:
                self.budgets[t.url].wake({"group": group, "vm": t.vm})

    def wait_idle(self, timeout: float) -> bool:
        return True

    def stop(self) -> None:
        pass


def member(store: CasStore, clock: FakeClock, name: str, zone: str = "1", needs: float = 60.0,
           hints: Hinter | None = None, url: str | None = None, **config: Any) -> tuple[Budget, Health]:
    """A member of group web; with `hints`, its releases' hints go there and it takes hints at `url` (default
    http://{name}:8088)."""
    health = Health()
    url = url if url is not None else f"http://{name}:8088" if hints is not None else ""
    budget = Budget(BudgetConfig(**{"group": "web", **config}), store=lambda: store, describe="fake store",
                    clock=clock, on_change=lambda: None, health=health, metrics=Metrics(), needs=lambda: needs,
                    lead_time=lambda: 0.0, wake_sender=hints, url=url)
    if isinstance(hints, Hints):
        hints.budgets[url] = budget
    budget.identify(name, zone, "0", "")
    return budget, health


def want(event_id: str, not_before: datetime, event_type: str = "Reboot") -> Want:
    return Want(event_id, event_type, not_before)
