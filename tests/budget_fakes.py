"""An in-memory store with the blob store's conditional writes, and a group of budgets on one fake clock."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from agent.clock import FakeClock
from agent.coordination.coordination_settings import BudgetConfig
from agent.coordination.store.store_protocol import Item, StoreError, Unchanged
from agent.fleet.budget import Budget, Want
from agent.fleet.budget_rules import Entry
from agent.fleet.budget_wake import Hinter
from agent.telemetry.metrics import Metrics
from tests.stopping import stopped_at_end


class CasStore:
    """Bodies with ETags: create if absent, replace if at the ETag; the clock is the store's Date."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.blobs: dict[str, tuple[bytes, str]] = {}
        self.lock = threading.Lock()
        self.n = 0
        self.down = False
        self.requests = 0
        self.ops: list[str] = []
        """Each request's kind: read, read_if_changed (a 200), not_modified (a 304), write."""
        self.at: list[float] = []
        """When each of `ops` was sent (the clock's monotonic reading)."""
        self.throttle_until: float | None = None
        """While the clock's monotonic reading is below this, every request answers 503 with `retry_after`."""
        self.retry_after = 86400.0

    def _check(self, op: str) -> None:
        self.requests += 1
        self.ops.append(op)
        self.at.append(self.clock.monotonic())
        if self.down:
            raise StoreError("unreachable", "store unreachable: connection refused")
        if self.throttle_until is not None and self.clock.monotonic() < self.throttle_until:
            raise StoreError("throttled", f"store answered 503 ServerBusy, Retry-After {self.retry_after:g}s",
                             retry_after=self.retry_after)

    def read_body(self, name: str) -> tuple[bytes, str, datetime] | None:
        with self.lock:
            self._check("read")
            found = self.blobs.get(name)
            return None if found is None else (found[0], found[1], self.clock.now())

    def read_if_changed(self, name: str, etag: str) -> tuple[bytes, str, datetime] | Unchanged | None:
        """If-None-Match: a 304 (`Unchanged`, no body) while the blob is still at `etag`, as Azure answers."""
        with self.lock:
            found = self.blobs.get(name)
            self._check("not_modified" if found is not None and found[1] == etag else "read_if_changed")
            if found is None:
                return None
            return Unchanged(etag, self.clock.now()) if found[1] == etag else (found[0], found[1], self.clock.now())

    def reads(self) -> int:
        """Reads of any kind (a 304 is a request too: it counts against the blob's rate like any other)."""
        return sum(op != "write" for op in self.ops)

    def write_body(self, name: str, body: bytes, etag: str | None) -> str | None:
        with self.lock:
            self._check("write")
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
    """Wake hints delivered in-process to the member of that name (or lost): a `WakeSender`'s stand-in, addressed
    as the real one is, by the member's name (never by the `url` its entry gives)."""

    def __init__(self) -> None:
        self.budgets: dict[str, Budget] = {}
        self.lost = False
        self.sent: list[str] = []

    def send(self, group: str, targets: Sequence[Entry]) -> None:
        for t in targets:
            self.sent.append(t.vm)
            if not self.lost and t.vm in self.budgets:
                self.budgets[t.vm].wake({"group": group, "vm": t.vm})

    def wait_idle(self, timeout: float) -> bool:
        return True

    def stop(self) -> None:
        pass


def member(store: CasStore, clock: FakeClock, name: str, zone: str = "1", needs: float = 60.0,
           hints: Hinter | None = None, url: str | None = None, rejoin: float = 0.0,
           **config: Any) -> tuple[Budget, Health]:
    """A member of group web; with `hints`, its releases' hints go there and it takes hints (by its name); `url`
    (default http://{name}:8088) is what it writes as its own address (shown only); `rejoin`: seconds it keeps its
    place once back in rotation (B7; the daemon's default is probe.lb_timeout)."""
    health = Health()
    url = url if url is not None else f"http://{name}:8088" if hints is not None else ""
    budget = Budget(BudgetConfig(**{"group": "web", **config}), store=lambda: store, describe="fake store",
                    clock=clock, on_change=lambda: None, health=health, metrics=Metrics(), needs=lambda: needs,
                    lead_time=lambda: 0.0, wake_sender=hints, url=url, rejoin_wait=lambda: rejoin)
    if isinstance(hints, Hints):
        hints.budgets[name] = budget
    budget.identify(name, zone, "0", "")
    stopped_at_end(budget)
    return budget, health


def want(event_id: str, not_before: datetime, event_type: str = "Reboot") -> Want:
    return Want(event_id, event_type, not_before)


class WholeStore(CasStore):
    """`CasStore` with the exchange's metadata records too (markers, listings, the claim): every path of one
    VM's store client (exchange, claim, budget) on one fake, throttled together."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.meta: dict[str, tuple[dict[str, str], str]] = {}

    def _meta(self, name: str, metadata: Mapping[str, str]) -> str:
        self.n += 1
        self.meta[name] = (dict(metadata), f"e{self.n}")
        return f"e{self.n}"

    def put(self, name: str, metadata: Mapping[str, str]) -> str | None:
        with self.lock:
            self._check("put")
            return self._meta(name, metadata)

    def list_folder(self, prefix: str) -> tuple[list[Item], datetime]:
        with self.lock:
            self._check("list")
            now = self.clock.now()
            return [Item(n, m, e, now) for n, (m, e) in self.meta.items() if n.startswith(prefix)], now

    def create(self, name: str, metadata: Mapping[str, str]) -> str | None:
        with self.lock:
            self._check("create")
            return None if name in self.meta else self._meta(name, metadata)

    def replace(self, name: str, metadata: Mapping[str, str], etag: str) -> str | None:
        with self.lock:
            self._check("replace")
            return self._meta(name, metadata) if name in self.meta and self.meta[name][1] == etag else None

    def read(self, name: str) -> tuple[dict[str, str], str] | None:
        with self.lock:
            self._check("read")
            return self.meta.get(name)

    def close(self) -> None:
        pass
