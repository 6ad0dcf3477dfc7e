"""Listing answers are bounded in bytes and in entries per page, whatever the store (or anything in its place)
sends; odd records are one summary line per listing, not a line each. `JunkStore` is a minimal stand-in for the
blob endpoint (loopback): marker writes are accepted, and a listing is answered with as much junk as asked."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.needs_azure  # noqa: F401 - skips this module without the azure extra
from agent.clock import FakeClock
from agent.coordination.store.blob_store import BlobStore, Settings
from agent.coordination.store.store_protocol import READY, Item, StoreError, event_folder
from tests.azurite import ACCOUNT, KEY
from tests.store.test_store_exchange import EVENT, MemoryStore, Rig
from tests.store.test_store_shapes import ITEM, VMS

ENTRY = ("<Blob><Name>{prefix}junk{n:09d}</Name><Properties><Last-Modified>Wed, 25 Nov 2026 12:00:00 GMT"
         "</Last-Modified><Etag>0x8D{n:012X}</Etag><Content-Length>0</Content-Length><BlobType>BlockBlob</BlobType>"
         "</Properties><Metadata><maintd>1</maintd><attempt></attempt></Metadata></Blob>")


class JunkStore:
    """A blob endpoint on 127.0.0.1: PUT answers 201 with an ETag; a List Blobs answers `entries` blobs, chunked
    (no Content-Length), generated as it is sent; `sent` counts the listing bytes the client took."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.sent = 0
        self.lists = 0
        self.finished = False
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _head(self, status: int, chunked: bool = False) -> None:
                self.send_response(status)
                self.send_header("Date", format_datetime(datetime.now(UTC), usegmt=True))
                self.send_header("ETag", '"0x8D000000000001"')
                self.send_header("Last-Modified", format_datetime(datetime.now(UTC), usegmt=True))
                self.send_header("x-ms-request-server-encrypted", "true")
                if chunked:
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", "0")
                self.end_headers()

            def do_PUT(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._head(201)

            def do_GET(self) -> None:
                store.lists += 1
                self._head(200, chunked=True)
                prefix = event_folder(EVENT)
                try:
                    self._chunk(b'<?xml version="1.0" encoding="utf-8"?><EnumerationResults><Blobs>')
                    batch: list[str] = []
                    for n in range(store.entries):
                        batch.append(ENTRY.format(prefix=prefix, n=n))
                        if len(batch) == 200:
                            self._chunk("".join(batch).encode())
                            batch = []
                    self._chunk(("".join(batch) + "</Blobs><NextMarker /></EnumerationResults>").encode())
                    self._chunk(b"")
                    store.finished = True
                except OSError:  # the client hung up: the bound did its job
                    self.close_connection = True

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
                store.sent += len(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/{ACCOUNT}"

    def connection_string(self) -> str:
        return f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={self.url};"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def junk_store() -> Iterator[JunkStore]:
    server = JunkStore(0)
    yield server
    server.stop()


def open_junk(server: JunkStore, outcomes: list[tuple[str, str]]) -> BlobStore:
    return BlobStore.open(Settings(server.url, "c", connection_string=server.connection_string()),
                          lambda op, outcome: outcomes.append((op, outcome)))


def test_a_50_mb_listing_is_not_read_past_the_bound(junk_store: JunkStore) -> None:
    """A listing answer of ~50 MB (without Content-Length): the request fails as `too_large` after at most
    MAX_ANSWER_BYTES read, the connection dropped (today: all 50 MB read, and 80,000 records parsed)."""
    junk_store.entries = 160_000
    outcomes: list[tuple[str, str]] = []
    store = open_junk(junk_store, outcomes)
    with pytest.raises(StoreError) as caught:
        store.list_folder(event_folder(EVENT))
    assert caught.value.outcome == "too_large"
    assert outcomes == [("list", "too_large")]
    assert junk_store.lists == 1, "retried by the SDK: maintd retries with its own backoff"
    # the answer was never read to its end (what the server wrote also fills the loopback's socket buffers,
    # up to tcp_rmem's 32 MiB, so its count is no measure of what maintd read)
    assert not junk_store.finished, f"all {junk_store.sent / 2**20:.0f} MiB were read"
    store.close()


def test_a_page_with_more_blobs_than_asked_for_is_refused(junk_store: JunkStore) -> None:
    """A page of 1000 blobs (under 1 MB) when maintd asked for 250: refused as `too_large`, not parsed."""
    junk_store.entries = 1000
    store = open_junk(junk_store, [])
    with pytest.raises(StoreError, match="1000 blobs, asked for at most 250"):
        store.list_folder(event_folder(EVENT))
    store.close()


def test_odd_records_are_one_log_line_per_listing_that_changed(clock: FakeClock, logs: list[dict]) -> None:
    """A thousand junk blobs in the event's folder, listed three times: one `store.invalid_record` line with the
    count (today: a thousand lines on the first listing)."""
    memory = MemoryStore()
    for n in range(1000):
        memory.put(f"{event_folder(EVENT)}junk{n}", {"attempt": ""})
    rig = Rig(memory, clock)
    for _ in range(3):
        rig.sync(("web_a",), "web_a", READY)
        clock.advance(60)
    lines = [e for e in logs if e["event"] == "store.invalid_record"]
    assert len(lines) == 1 and lines[0]["count"] == 1000 and len(lines[0]["more"]) == 4


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ITEM, max_size=6))
def test_any_listing_through_the_exchange_leaves_the_event_free_to_ask_again(clock: FakeClock,
                                                                           items: list[Item]) -> None:
    """Whatever a listing holds, the exchange takes it in (or fails it like any store error): the event is never
    left busy, and a verdict is always there (today: a listing with a None value left the event busy for good)."""
    class Listed(MemoryStore):
        lists = 0

        def list_folder(self, prefix: str):
            self.lists += 1
            return items, datetime.now(UTC)

    store = Listed()
    rig = Rig(store, clock)
    rig.sync(VMS, VMS[0], READY)
    step = rig.exchange.verdict(EVENT, VMS, VMS[0], 60)[1]
    assert step.action in ("wait", "claim", "take_over", "done")
    clock.advance(61)
    rig.sync(VMS, VMS[0], READY)
    assert step.action == "done" or store.lists == 2, "the event never asked the store again"
    rig.exchange.stop()
