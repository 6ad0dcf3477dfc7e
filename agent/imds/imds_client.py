"""The only code that talks to IMDS: Scheduled Events GET and POST, and this VM's compute identity.

Requests go over `agent.imds.imds_connection` connections opened straight to the endpoint, so HTTP(S)_PROXY never
redirects IMDS calls (IMDS must not be reached through a proxy). Every request sends `Metadata: true`.
Answers are bounded before they are parsed (size, nesting depth, field sizes) and anything that
cannot be read (status line, any header, body) is a failed request (`ImdsError`), never an exception the
caller did not ask for: every answer is read inside one guard (`ImdsClient._request`). The poll loop is
its own retry: `get_document` never retries; `cadence.next_poll_delay` says how long to wait after a failure
(exponential with jitter, capped, honouring Retry-After).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlencode

from agent.clock import Clock
from agent.errors import AnswerTooLarge, ImdsError, ImdsRequestRejected, ImdsUnavailable
from agent.imds.imds_connection import Connection, Reply, request_bytes, safe_header_value
from agent.model.events import MAX_NAME, Document, parse_document
from agent.model.identity import Identity, identity_from_compute
from agent.net.addresses import is_loopback_url
from agent.net.httpdates import retry_after
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics
from agent.trust import jsonsafe

SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents"
COMPUTE_PATH = "/metadata/instance/compute"
IDENTITY_PATH, IDENTITY_API_VERSION = "/metadata/identity/oauth2/token", "2018-02-01"
"""The managed identity's token endpoint (the store backend's credential)."""
HEADERS = {"Metadata": "true", "User-Agent": "maintd"}
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
"""Largest Scheduled Events answer read: a 1000-event document is about 320 KB, so ~12 000 events fit."""
MAX_SMALL_BYTES = 256 * 1024
"""Largest compute metadata or approval answer read (a real compute document is a few KB)."""
MAX_RETRY_AFTER = 300.0
"""Longest Retry-After honoured: IMDS asks for seconds (410: "a max of 70 seconds"); a hostile or broken
answer asking for a day would stop polling for a day, and 5000 nines for good."""
MIN_REQUEST_GAP = 0.25
"""Seconds between two requests to a real IMDS: 4 req/s, under its shared per-VM limit of 5."""

T = TypeVar("T")


@dataclass(frozen=True)
class PollResult:
    """A successful poll: a new document, or `unchanged` (a 304, or the same bytes as the last document)."""

    document: Document | None
    unchanged: bool
    duration: float



def _text(body: bytes) -> str:
    return body[:500].decode("utf-8", "replace")


class ImdsClient:
    """IMDS client bound to one endpoint; thread-safe (the approval worker and the loop share it).

    The poll owns one keep-alive connection and the request bytes for it (rebuilt only when the
    ETag changes); the rare calls (approval, compute metadata) each open their own, so no caller
    waits on another's.
    """

    def __init__(self, endpoint: str, api_version: str, *, timeout: float, first_timeout: float,
                 compute_api_version: str, clock: Clock, metrics: Metrics) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.api_version = api_version
        self.timeout = timeout
        self.first_timeout = first_timeout
        self.compute_api_version = compute_api_version
        self.clock = clock
        self.metrics = metrics
        self._poll = Connection(self.endpoint)
        self._etag: str | None = None
        self._poll_request = self._get_bytes(SCHEDULED_EVENTS_PATH, api_version)
        self._last: tuple[bytes, Document] | None = None
        """The last document and the body it came from: the same bytes again are `unchanged`."""
        self._answered = False
        self._lock = threading.Lock()
        self._last_request = float("-inf")
        self._min_gap = 0.0 if is_loopback_url(self.endpoint) else MIN_REQUEST_GAP

    def _target(self, path: str, api_version: str) -> str:
        return f"{path}?{urlencode({'api-version': api_version})}"

    def _get_bytes(self, path: str, api_version: str, etag: str | None = None) -> bytes:
        extra = {"If-None-Match": etag} if etag else {}
        return request_bytes("GET", self._poll.host_header, self._target(path, api_version),
                             {**HEADERS, **extra})

    def _pace(self) -> None:
        with self._lock:
            wait = self._last_request + self._min_gap - self.clock.monotonic()
            if wait > 0:
                self.clock.sleep(wait)
            self._last_request = self.clock.monotonic()

    def _request(self, endpoint_label: str, connection: Connection, request: bytes, *, timeout: float,
                 max_body: int, read: Callable[[Reply], T]) -> T:
        """One exchange, timed and counted, and its answer `read`; any transport failure, oversize answer or
        failure to read it (whatever `read` raises) is an ImdsError, never anything else."""
        self._pace()
        start = self.clock.monotonic()
        try:
            reply = connection.exchange(request, timeout, max_body)
        except Exception as exc:  # whatever the wire brings (the parser too) fails the request
            self.metrics.imds_requests.labels(endpoint_label, "error").inc()
            self.metrics.imds_duration.labels(endpoint_label).observe(self.clock.monotonic() - start)
            kind = ("timed out" if isinstance(exc, TimeoutError) else
                    "answer too large" if isinstance(exc, AnswerTooLarge) else
                    "connection failed" if isinstance(exc, OSError) else "answer unreadable")
            raise ImdsUnavailable(f"IMDS {kind}: {type(exc).__name__}: {str(exc)[:200]}") from exc
        self.metrics.imds_requests.labels(endpoint_label, str(reply.status)).inc()
        self.metrics.imds_duration.labels(endpoint_label).observe(self.clock.monotonic() - start)
        try:
            return read(reply)
        except ImdsError:
            raise
        except Exception as exc:  # no status, header or body may end the caller's loop
            raise ImdsUnavailable(f"IMDS answer unreadable: {type(exc).__name__}: {str(exc)[:200]}",
                                  reply.status, _text(reply.body)[:200]) from exc

    def _once(self, endpoint_label: str, request: bytes, timeout: float, read: Callable[[Reply], T]) -> T:
        """A rare call on a connection of its own, closed after it."""
        with closing(Connection(self.endpoint)) as connection:
            return self._request(endpoint_label, connection, request, timeout=timeout, max_body=MAX_SMALL_BYTES,
                                 read=read)

    def _retry_after(self, reply: Reply) -> float | None:
        header = reply.header("Retry-After").strip()
        seconds = retry_after(header, self.clock.now(), MAX_RETRY_AFTER)
        if seconds is None and header:
            logs.get("imds").warning("imds.retry_after_ignored", value=header[:100], status=reply.status,
                                     reason="neither ASCII digits nor an HTTP-date")
        return seconds

    def _raise_for(self, reply: Reply) -> None:
        status = reply.status
        if 200 <= status < 300 or status == 304:
            return
        body = _text(reply.body)
        retry_after = self._retry_after(reply)
        if status in (400, 405):
            raise ImdsRequestRejected(f"IMDS rejected the request ({status})", status, body)
        raise ImdsUnavailable(f"IMDS answered {status}", status, body, retry_after)

    @property
    def next_timeout(self) -> float:
        """The timeout of the next poll: `first_timeout` until IMDS has answered once, then `timeout`."""
        return self.timeout if self._answered else max(self.timeout, self.first_timeout)

    def get_document(self) -> PollResult:
        """Poll Scheduled Events once within its timeout (connect, headers, body); raises ImdsError on any
        failure, including any answer that cannot be read as a document (never retries)."""
        start = self.clock.monotonic()
        return self._request("scheduledevents", self._poll, self._poll_request, timeout=self.next_timeout,
                             max_body=MAX_DOCUMENT_BYTES, read=lambda reply: self._poll_result(reply, start))

    def _poll_result(self, reply: Reply, start: float) -> PollResult:
        self._raise_for(reply)
        self._answered = True
        duration = self.clock.monotonic() - start
        if reply.status == 304:
            return PollResult(None, True, duration)
        content_type = reply.header("Content-Type")
        if "json" not in content_type.lower():
            raise ImdsUnavailable(f"IMDS answered {reply.status} with Content-Type {content_type[:100]!r}, "
                                  "not JSON (is a proxy in the path?)", reply.status, _text(reply.body)[:200])
        if self._last is not None and reply.body == self._last[0]:  # nearly every poll at 1 Hz
            return PollResult(None, True, duration)
        try:
            document = parse_document(jsonsafe.loads(reply.body, max_bytes=MAX_DOCUMENT_BYTES),
                                      self._last[1] if self._last else None)
        except Exception as exc:  # whatever the bytes do to the parser, the poll fails, the loop goes on
            self.metrics.documents_malformed.inc()
            raise ImdsUnavailable(f"malformed Scheduled Events document: {type(exc).__name__}: {str(exc)[:200]}",
                                  reply.status, _text(reply.body)[:200]) from exc
        self._remember_etag(safe_header_value(reply.header("ETag")) or None)
        self._last = (reply.body, document)
        return PollResult(document, False, duration)

    def interrupt(self) -> None:
        """Make a poll under way fail at once (a SIGTERM need not wait for its timeout); signal-safe."""
        self._poll.interrupt()

    def close(self) -> None:
        """Close the kept poll socket (a reload replaced this client); approvals open their own connections."""
        self._poll.close()

    def _remember_etag(self, etag: str | None) -> None:
        if etag != self._etag:
            self._etag = etag
            self._poll_request = self._get_bytes(SCHEDULED_EVENTS_PATH, self.api_version, etag)

    def approve(self, event_ids: list[str]) -> None:
        """POST StartRequests for `event_ids`; raises ImdsError unless IMDS answers 2xx."""
        body = json.dumps({"StartRequests": [{"EventId": e} for e in event_ids]}).encode()
        request = request_bytes("POST", self._poll.host_header,
                                self._target(SCHEDULED_EVENTS_PATH, self.api_version),
                                {**HEADERS, "Content-Type": "application/json"}, body)
        self._once("approve", request, self.timeout, read=self._raise_for)

    def compute_identity(self) -> Identity:
        """This VM's `compute.name` (what Resources lists), computer name and scale set; raises ImdsError,
        whatever the answer holds."""
        return self._once("compute", self._get_bytes(COMPUTE_PATH, self.compute_api_version), max(self.timeout, 10.0),
                          read=self._identity)

    def _identity(self, reply: Reply) -> Identity:
        self._raise_for(reply)
        try:
            identity = identity_from_compute(jsonsafe.loads(reply.body, max_bytes=MAX_SMALL_BYTES))
        except Exception as exc:  # as for the document: any failure to read it fails the request
            raise ImdsUnavailable(f"compute metadata is not usable: {type(exc).__name__}: {str(exc)[:200]}",
                                  reply.status, _text(reply.body)) from exc
        if len(identity.name) > MAX_NAME or not identity.name.isprintable():
            raise ImdsUnavailable("compute metadata has no usable name", reply.status, _text(reply.body))
        return identity

    def identity_token(self, resource: str, client_id: str | None) -> bytes:
        """The managed identity's token answer for `resource` (a user-assigned one by `client_id`), as IMDS
        sent it (`coordination.identity_token` reads it); raises ImdsError unless IMDS answers 2xx."""
        query = {"api-version": IDENTITY_API_VERSION, "resource": resource,
                 **({"client_id": client_id} if client_id else {})}
        request = request_bytes("GET", self._poll.host_header, f"{IDENTITY_PATH}?{urlencode(query)}", HEADERS)
        return self._once("identity", request, max(self.timeout, 10.0), read=self._body)

    def _body(self, reply: Reply) -> bytes:
        self._raise_for(reply)
        return reply.body


def is_transient(exc: BaseException) -> bool:
    """Whether retrying may help (tenacity predicate): anything but a rejected request."""
    return isinstance(exc, ImdsError) and not isinstance(exc, ImdsRequestRejected)
