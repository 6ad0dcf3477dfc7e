"""The store exchange on an in-memory store: the loop owns the state, workers hand results back, failures hold."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from datetime import UTC, datetime

import pytest

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from agent.clock import FakeClock
from agent.coordination.store.identity_token import ManagedIdentityCredential, parse_token, refresh_due
from agent.coordination.store.store_claim import StoreClaims
from agent.coordination.store.store_exchange import StoreExchange
from agent.coordination.store.store_protocol import (
    APPROVED,
    PREPARING,
    READY,
    Item,
    StoreError,
    approval_blob,
    marker_blob,
)
from tests.stopping import stopped_at_end

EVENT = "5F1E2B0C-9A4D-4C61-8E2F-1A2B3C4D5E6F"


class MemoryStore:
    """Blob semantics that matter here: ETags, If-None-Match: *, If-Match; `fail` makes every request fail."""

    def __init__(self) -> None:
        self.blobs: dict[str, tuple[dict[str, str], str]] = {}
        self.ops: list[str] = []
        self.fail: StoreError | None = None
        self.lock = threading.Lock()
        self.n = 0

    def _write(self, name: str, metadata: Mapping[str, str]) -> str:
        self.n += 1
        self.blobs[name] = (dict(metadata), f"etag{self.n}")
        return f"etag{self.n}"

    def _op(self, op: str) -> None:
        self.ops.append(op)
        if self.fail is not None:
            raise self.fail

    def put(self, name: str, metadata: Mapping[str, str]) -> str:
        with self.lock:
            self._op("put")
            return self._write(name, metadata)

    def list_folder(self, prefix: str) -> tuple[list[Item], datetime]:
        with self.lock:
            self._op("list")
            now = datetime.now(UTC)
            return [Item(n, m, e, now) for n, (m, e) in self.blobs.items() if n.startswith(prefix)], now

    def create(self, name: str, metadata: Mapping[str, str]) -> str | None:
        with self.lock:
            self._op("create")
            return None if name in self.blobs else self._write(name, metadata)

    def replace(self, name: str, metadata: Mapping[str, str], etag: str) -> str | None:
        with self.lock:
            self._op("replace")
            return self._write(name, metadata) if name in self.blobs and self.blobs[name][1] == etag else None

    def read(self, name: str) -> tuple[dict[str, str], str] | None:
        with self.lock:
            self._op("read")
            return self.blobs.get(name)

    def close(self) -> None:
        pass


class Rig:
    def __init__(self, store: MemoryStore, clock: FakeClock) -> None:
        self.reports: list[tuple[str, bool, str]] = []
        self.exchange = StoreExchange(lambda: store, "memory/maintd", clock, on_change=lambda: None,
                                      report=lambda key, ok, why: self.reports.append((key, ok, why)),
                                      takeover_after=lambda: 60.0)
        stopped_at_end(self.exchange)
        self.claims = StoreClaims(self.exchange)
        self.clock = clock

    def sync(self, vms: tuple[str, ...], me: str, marker: str, listing: bool = True) -> None:
        """One loop tick's request and its answer taken in."""
        self.exchange.run(EVENT, vms, me, (marker, "ok"), listing, self.clock.monotonic())
        assert self.exchange.wait_idle(5)
        self.exchange.apply(self.clock.monotonic())


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


def test_the_last_vm_ready_claims_posts_once_and_records_the_approval(store: MemoryStore, clock: FakeClock) -> None:
    """Two VMs: the first records itself ready and waits; the last one's own list finds everyone ready and claims;
    the other's claim afterwards loses; the record says approved by the winner."""
    vms = ("web_3f2a9c1b", "web_7c0d11e4")
    a, b = Rig(store, clock), Rig(store, clock)
    a.sync(vms, vms[0], READY)
    assert a.exchange.verdict(EVENT, vms, vms[0], 60)[1].action == "wait"
    b.sync(vms, vms[1], READY)
    not_ready, step = b.exchange.verdict(EVENT, vms, vms[1], 60)
    assert not_ready == [] and step.action == "claim"
    claim = b.claims.claim(EVENT, vms[1], step)
    assert claim.won
    assert b.claims.settle(EVENT, vms[1], claim, approved=True)
    lost = a.claims.claim(EVENT, vms[0], step)
    assert not lost.won
    b.exchange.apply(clock.monotonic())
    assert b.exchange.verdict(EVENT, vms, vms[1], 60)[1].action == "done"
    assert store.blobs[approval_blob(EVENT)][0]["state"] == APPROVED
    assert store.blobs[approval_blob(EVENT)][0]["by"] == vms[1]


def test_markers_are_written_once_per_state_and_lists_back_off(store: MemoryStore, clock: FakeClock) -> None:
    """`preparing` then `ready`, each written once; in between, background lists only when due (2.5 s, 5 s, ...)."""
    vms = ("web_3f2a9c1b", "web_7c0d11e4")
    rig = Rig(store, clock)
    rig.sync(vms, vms[0], PREPARING)
    rig.sync(vms, vms[0], PREPARING)
    assert store.ops == ["put", "list"]
    clock.advance(2.5)
    rig.sync(vms, vms[0], PREPARING)
    assert store.ops == ["put", "list", "list"]
    clock.advance(4)
    rig.sync(vms, vms[0], PREPARING)
    assert store.ops.count("list") == 2
    rig.sync(vms, vms[0], READY)
    assert store.ops[-2:] == ["put", "list"] and store.blobs[marker_blob(EVENT, vms[0])][0]["state"] == READY


def test_a_failing_store_holds_the_approval_reports_it_and_recovers(store: MemoryStore, clock: FakeClock,
                                                                    logs: list[dict]) -> None:
    """The store answers 503: no claim (wait, with the reason), a warning log and report; back: reported OK, and
    the marker that failed is written."""
    vm = ("web_3f2a9c1b",)
    rig = Rig(store, clock)
    store.fail = StoreError("server_error", "store answered 503 ServerBusy")
    rig.sync(vm, vm[0], READY)
    _, step = rig.exchange.verdict(EVENT, vm, vm[0], 60)
    assert step.action == "wait" and "503" in step.reason
    assert rig.reports == [("store", False, "server_error: store answered 503 ServerBusy")]
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["store.request_failed"]
    assert "last answer" not in rig.exchange.publish().last_outcome and "503" in rig.exchange.snapshot.last_outcome
    store.fail = None
    rig.sync(vm, vm[0], READY)
    assert step.action == "wait" and store.ops[-1] == "put"  # not due yet: 1 s backoff
    clock.advance(1)
    rig.sync(vm, vm[0], READY)
    assert rig.reports[-1] == ("store", True, "the store answers")
    assert rig.exchange.verdict(EVENT, vm, vm[0], 60)[1].action == "claim"
    assert rig.exchange.publish().last_outcome == "ok"


def test_a_marker_naming_another_vm_is_logged_reported_and_not_ready(store: MemoryStore, clock: FakeClock,
                                                                     logs: list[dict]) -> None:
    """A marker at web_b's name that says web_c: web_b is not ready, the problem is logged and reported once."""
    vms = ("web_a", "web_b")
    store.put(marker_blob(EVENT, "web_b"), {"maintd": "1", "kind": "vm", "event": EVENT.lower(), "vm": "web_c",
                                            "state": READY, "health": "ok"})
    rig = Rig(store, clock)
    rig.sync(vms, "web_a", READY)
    not_ready, step = rig.exchange.verdict(EVENT, vms, "web_a", 60)
    assert not_ready == ["web_b"] and step.action == "wait"
    assert any(e["event"] == "store.invalid_record" and "web_c" in e["problem"] for e in logs)
    view = rig.exchange.publish().events[0]
    assert rig.reports[-1][:2] == ("store_records", False) and "web_c" in rig.reports[-1][2]
    assert dict(view.vms) == {"web_a": READY, "web_b": "not seen"} and view.problems


def test_a_lost_claim_waits_for_a_fresh_listing_instead_of_trying_again(store: MemoryStore, clock: FakeClock) -> None:
    """After losing the race, the stale listing no longer says `claim`: the VM waits and relists at once."""
    vm = ("web_a",)
    rig = Rig(store, clock)
    rig.sync(vm, "web_a", READY)
    step = rig.exchange.verdict(EVENT, vm, "web_a", 60)[1]
    store.create(approval_blob(EVENT), {"maintd": "1", "kind": "approval", "event": EVENT.lower(), "by": "web_a",
                                        "state": "claimed", "attempt": "7"})
    assert not rig.claims.claim(EVENT, "web_a", step).won
    rig.exchange.apply(clock.monotonic())
    assert rig.exchange.verdict(EVENT, vm, "web_a", 60)[1].action == "wait"
    rig.sync(vm, "web_a", READY)
    assert store.ops[-1] == "list"


def test_an_sdk_retry_of_our_own_create_still_counts_as_our_claim(store: MemoryStore, clock: FakeClock) -> None:
    """A 409 caused by the SDK retrying this VM's own successful create: the record is ours (same VM, same
    attempt), so the claim stands."""
    vm = ("web_a",)
    rig = Rig(store, clock)
    rig.sync(vm, "web_a", READY)
    step = rig.exchange.verdict(EVENT, vm, "web_a", 60)[1]
    store.create(approval_blob(EVENT), {"maintd": "1", "kind": "approval", "event": EVENT.lower(), "by": "web_a",
                                        "state": "claimed", "attempt": "1"})
    assert rig.claims.claim(EVENT, "web_a", step).won


# --- the managed-identity token ---------------------------------------------------------------

def test_a_token_is_cached_and_refreshed_five_minutes_before_it_expires() -> None:
    """One IMDS request per token; a new one only when fewer than 300 s are left."""
    now = [1_000_000.0]
    asked: list[tuple[str, str | None]] = []

    def fetch(resource: str, client_id: str | None) -> bytes:
        asked.append((resource, client_id))
        return b'{"access_token": "tok%d", "expires_on": "%d", "token_type": "Bearer"}' % (len(asked), now[0] + 3600)

    cred = ManagedIdentityCredential(fetch, "cid", lambda: now[0])
    assert cred.get_token("https://storage.azure.com/.default").token == "tok1"
    now[0] += 3000
    assert cred.get_token("https://storage.azure.com/.default").token == "tok1"
    now[0] += 301
    assert cred.get_token("https://storage.azure.com/.default").token == "tok2"
    assert asked == [("https://storage.azure.com/", "cid")] * 2


def test_a_failed_refresh_keeps_a_valid_token_and_no_token_is_an_auth_error() -> None:
    """IMDS failing while the cached token is still valid: it is used; with none left, ClientAuthenticationError."""
    from azure.core.exceptions import ClientAuthenticationError

    now = [1_000_000.0]
    answers = [b'{"access_token": "tok", "expires_on": %d}' % (now[0] + 600)]

    def fetch(resource: str, client_id: str | None) -> bytes:
        if not answers:
            raise OSError("IMDS said 400: Identity not found")
        return answers.pop()

    cred = ManagedIdentityCredential(fetch, None, lambda: now[0])
    assert cred.get_token("https://storage.azure.com/.default").token == "tok"
    now[0] += 500
    assert cred.get_token("https://storage.azure.com/.default").token == "tok"
    now[0] += 200
    with pytest.raises(ClientAuthenticationError, match="Identity not found"):
        cred.get_token("https://storage.azure.com/.default")


@pytest.mark.parametrize("body", [b"[]", b'{"access_token": "", "expires_on": 2000000000}',
                                  b'{"access_token": "a b", "expires_on": 2000000000}',
                                  b'{"access_token": "t", "expires_on": 5}', b'{"access_token": "t"}', b"\xff"])
def test_an_answer_that_is_not_a_token_is_refused(body: bytes) -> None:
    """No token, a token with spaces (would split a header), an expired or missing expiry: refused."""
    with pytest.raises(ValueError):
        parse_token(body, 1_000_000.0)


def test_short_tokens_are_refreshed_at_half_their_life() -> None:
    """A token valid for 10 minutes is replaced after 5, not 5 minutes before its end (which would be at once)."""
    token = parse_token(b'{"access_token": "t", "expires_on": 1000600}', 1_000_000.0)
    assert not refresh_due(token, 1_000_299.0) and refresh_due(token, 1_000_300.0)


def test_a_marker_the_store_lost_is_written_again(store: MemoryStore, clock: FakeClock, logs: list[dict]) -> None:
    """The store comes back empty (or someone deleted the blob): the next listing shows this VM's marker gone,
    and the VM writes it again by itself."""
    vm = ("web_a",)
    rig = Rig(store, clock)
    rig.sync(vm, "web_a", READY)
    store.blobs.clear()
    clock.advance(2.5)
    rig.sync(vm, "web_a", READY)
    assert any(e["event"] == "store.marker_missing" for e in logs)
    rig.sync(vm, "web_a", READY)
    assert store.ops[-2:] == ["put", "list"] and marker_blob(EVENT, "web_a") in store.blobs
