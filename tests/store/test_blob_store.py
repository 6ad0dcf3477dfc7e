"""The blob store edge against a real Azurite: the atomic step, listing, and what each failure looks like."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

import pytest

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from agent.coordination.store.blob_store import BlobStore, Settings
from agent.coordination.store.store_protocol import (
    CLAIMED,
    READY,
    StoreError,
    approval_blob,
    approval_record,
    event_folder,
    marker_blob,
    marker_record,
    next_step,
    parse_listing,
)
from tests.azurite import Azurite, azurite  # noqa: F401 - the fixture

EVENT = "5F1E2B0C-9A4D-4C61-8E2F-1A2B3C4D5E6F"
VMS = ("web_3f2a9c1b", "web_7c0d11e4", "web_90ab12cd")


class Counts:
    def __init__(self) -> None:
        self.seen: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()

    def __call__(self, op: str, outcome: str) -> None:
        with self.lock:
            self.seen[(op, outcome)] += 1


def open_store(server: Azurite, container: str | None = None, counts: Counts | None = None) -> BlobStore:
    name = container or server.new_container()
    return BlobStore.open(Settings(server.url, name, connection_string=server.connection_string()),
                          counts or Counts())


def test_create_if_absent_has_one_winner_and_if_match_refuses_a_stale_etag(azurite: Azurite) -> None:
    """The atomic step: a second create of the approval record is refused, and so is an If-Match on an old ETag."""
    counts = Counts()
    store = open_store(azurite, counts=counts)
    first = store.create(approval_blob(EVENT), approval_record(EVENT, VMS[0], CLAIMED, 1))
    assert first is not None
    assert store.create(approval_blob(EVENT), approval_record(EVENT, VMS[1], CLAIMED, 1)) is None
    second = store.replace(approval_blob(EVENT), approval_record(EVENT, VMS[1], CLAIMED, 2), first)
    assert second is not None and second != first
    assert store.replace(approval_blob(EVENT), approval_record(EVENT, VMS[2], CLAIMED, 3), first) is None
    metadata, etag = store.read(approval_blob(EVENT)) or ({}, "")
    assert metadata["by"] == VMS[1] and metadata["attempt"] == "2" and etag == second
    assert counts.seen[("create", "conflict")] == 1 and counts.seen[("replace", "conflict")] == 1


def test_one_list_returns_every_marker_the_record_and_the_store_clock(azurite: Azurite) -> None:
    """A list of the event's folder is the whole event: markers with their state, the record with its ETag, ages
    from the store's own Date."""
    store = open_store(azurite)
    for vm in VMS:
        store.put(marker_blob(EVENT, vm), marker_record(EVENT, vm, READY))
    etag = store.create(approval_blob(EVENT), approval_record(EVENT, VMS[0], CLAIMED, 1))
    items, server_time = store.list_folder(event_folder(EVENT))
    assert abs((server_time - datetime.now(UTC)).total_seconds()) < 5
    listing = parse_listing(EVENT, items, server_time, VMS)
    assert listing.problems == ()
    assert sorted(listing.markers) == sorted(VMS)
    assert listing.approval is not None and listing.approval.by == VMS[0] and listing.approval.age < 5
    step = next_step(listing, VMS, VMS[1], takeover_after=0)
    assert step.action == "take_over"
    assert store.replace(approval_blob(EVENT), approval_record(EVENT, VMS[1], CLAIMED, 2), step.etag) is not None
    assert etag is not None


T = TypeVar("T")


def at_once(racers: int, race: Callable[[str], T]) -> list[T]:
    """`race(vm_i)` on `racers` threads released together by a barrier: what each returned."""
    barrier = threading.Barrier(racers)
    results: list[T] = []
    lock = threading.Lock()

    def run(vm: str) -> None:
        barrier.wait()
        result = race(vm)
        with lock:
            results.append(result)

    threads = [threading.Thread(target=run, args=(f"vm_{i}",)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_fifty_racers_one_winner_a_hundred_times(azurite: Azurite) -> None:
    """50 store clients race to claim one event, 100 times (fresh events): exactly one wins each time."""
    store = open_store(azurite)
    for round_ in range(100):
        event = f"00000000-0000-4000-8000-{round_:012d}"
        won = at_once(50, lambda vm, e=event: store.create(approval_blob(e), approval_record(e, vm, CLAIMED, 1)))
        wins = [w for w in won if w is not None]
        assert len(wins) == 1, f"round {round_}: {wins}"


def test_a_missing_container_is_not_found_and_says_so(azurite: Azurite) -> None:
    """A container nobody created: a `not_found` failure that names the likely cause."""
    counts = Counts()
    store = open_store(azurite, container="nosuchcontainer", counts=counts)
    with pytest.raises(StoreError) as caught:
        store.list_folder(event_folder(EVENT))
    assert caught.value.outcome == "not_found" and "container" in str(caught.value)
    assert counts.seen[("list", "not_found")] == 1


def test_a_wrong_key_is_denied(azurite: Azurite) -> None:
    """Credentials the store refuses: `denied`, with the role it takes."""
    container = azurite.new_container()
    bad = azurite.connection_string().replace("AccountKey=Eby8", "AccountKey=Xby8")
    store = BlobStore.open(Settings(azurite.url, container, connection_string=bad), Counts())
    with pytest.raises(StoreError) as caught:
        store.put(marker_blob(EVENT, VMS[0]), marker_record(EVENT, VMS[0], READY))
    assert caught.value.outcome == "denied" and "Storage Blob Data Contributor" in str(caught.value)


def test_a_stopped_store_is_unreachable(tmp_path) -> None:
    """Nothing listening: `unreachable`, within the client's timeouts."""
    from tests.azurite import start

    server = start(tmp_path)
    store = open_store(server)
    server.stop()
    with pytest.raises(StoreError) as caught:
        store.list_folder(event_folder(EVENT))
    assert caught.value.outcome == "unreachable"


def test_a_large_event_is_listed_whole_a_page_at_a_time(azurite: Azurite) -> None:
    """600 markers: one listing returns every one, in 250-blob pages, each page counted as a request."""
    import concurrent.futures

    counts = Counts()
    store = open_store(azurite, counts=counts)
    names = [f"web_{i:08x}" for i in range(600)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: store.put(marker_blob(EVENT, n), marker_record(EVENT, n, READY)), names))
    items, _ = store.list_folder(event_folder(EVENT))
    assert len(items) == 600 and counts.seen[("list", "ok")] == 3


def test_a_conditional_read_is_a_304_without_a_body_until_the_record_changes(azurite: Azurite) -> None:
    """B4 on the real SDK: If-None-Match on the ETag last read answers `Unchanged` (a 304, counted not_modified) with
    the store's Date, and the new body and ETag once someone rewrote the record; an absent record is None."""
    from agent.coordination.store.store_protocol import Unchanged

    counts = Counts()
    store = open_store(azurite, counts=counts)
    assert store.read_if_changed("budget/web/places", '"0x0"') is None
    etag = store.write_body("budget/web/places", b'{"v": 1}', None)
    assert etag is not None
    body, seen, _ = store.read_body("budget/web/places") or (b"", "", None)
    assert (body, seen) == (b'{"v": 1}', etag)
    same = store.read_if_changed("budget/web/places", etag)
    assert isinstance(same, Unchanged) and same.etag == etag
    assert abs((same.date - datetime.now(UTC)).total_seconds()) < 60  # the store's Date, not a stand-in
    assert counts.seen[("read", "not_modified")] == 1
    newer = store.write_body("budget/web/places", b'{"v": 2}', etag)
    changed = store.read_if_changed("budget/web/places", etag)
    assert not isinstance(changed, Unchanged) and changed is not None and changed[:2] == (b'{"v": 2}', newer)
