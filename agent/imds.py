"""The only code that talks to IMDS: Scheduled Events GET and POST, and this VM's compute identity.

One keep-alive `requests.Session` with `trust_env = False`, so HTTP(S)_PROXY never redirects IMDS
calls (IMDS must not be reached through a proxy). Every request sends `Metadata: true`. The poll
loop is its own retry: `get_document` never retries; `next_poll_delay` says how long to wait after
a failure (exponential with jitter, capped, honouring Retry-After).
"""

from __future__ import annotations

import email.utils
import random
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable
from urllib.parse import urlsplit

import requests

from agent import jsonsafe
from agent.addressing import Identity, identity_from_compute
from agent.clock import Clock
from agent.errors import ImdsError, ImdsRequestRejected, ImdsUnavailable
from agent.events import Document, DocumentError, parse_document
from agent.metrics import Metrics

SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents"
COMPUTE_PATH = "/metadata/instance/compute"
COMPUTE_MAX_BYTES = 1024 * 1024
MIN_REQUEST_GAP = 0.25
"""Seconds between two requests to a real IMDS: 4 req/s, under its shared per-VM limit of 5."""


@dataclass(frozen=True)
class PollResult:
    """A successful poll: a new document, or `unchanged` (a 304, or the same bytes as the last document)."""

    document: Document | None
    unchanged: bool
    duration: float


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP-date); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - now).total_seconds())


def next_poll_delay(failures: int, interval: float, max_backoff: float, retry_after: float | None,
                    rand: Callable[[], float] = random.random) -> float:
    """Delay before the next poll after `failures` failed polls in a row (0 = the normal cadence).

    Exponential (interval × 2^(failures-1)) with ±25 % jitter, capped at `max_backoff` but never
    below the interval; a Retry-After from IMDS is honoured even beyond the cap.
    """
    if failures <= 0:
        return interval
    base = min(max_backoff, interval * (2 ** min(failures - 1, 30)))
    delay = max(interval, base * (0.75 + 0.5 * rand()))
    delay = min(delay, max(max_backoff, interval))
    if retry_after is not None:
        delay = max(delay, retry_after)
    return delay


def _is_loopback(endpoint: str) -> bool:
    host = urlsplit(endpoint).hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


class ImdsClient:
    """IMDS client bound to one endpoint; thread-safe (the approval worker and the loop share it)."""

    def __init__(self, endpoint: str, api_version: str, *, timeout: float, first_timeout: float,
                 compute_api_version: str, clock: Clock, metrics: Metrics,
                 session: requests.Session | None = None) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.api_version = api_version
        self.timeout = timeout
        self.first_timeout = first_timeout
        self.compute_api_version = compute_api_version
        self.clock = clock
        self.metrics = metrics
        self.session = session or requests.Session()
        self.session.trust_env = False
        self.session.proxies = {"http": None, "https": None}  # type: ignore[dict-item]
        self.session.headers.update({"Metadata": "true", "User-Agent": "maintd"})
        self._etag: str | None = None
        self._last: tuple[bytes, Document] | None = None
        """The last document and the body it came from: the same bytes again are `unchanged`."""
        self._answered = False
        self._lock = threading.Lock()
        self._last_request = float("-inf")
        self._min_gap = 0.0 if _is_loopback(self.endpoint) else MIN_REQUEST_GAP

    def _pace(self) -> None:
        with self._lock:
            wait = self._last_request + self._min_gap - self.clock.monotonic()
            if wait > 0:
                self.clock.sleep(wait)
            self._last_request = self.clock.monotonic()

    def _request(self, endpoint_label: str, method: str, path: str, *, params: dict[str, str],
                 timeout: float, headers: dict[str, str] | None = None, json_body: Any = None) -> requests.Response:
        self._pace()
        start = self.clock.monotonic()
        try:
            response = self.session.request(method, self.endpoint + path, params=params, headers=headers,
                                            json=json_body, timeout=(min(timeout, 5.0), timeout),
                                            allow_redirects=False)
            _ = response.content  # read the whole body inside the timing and the error handling
        except requests.RequestException as exc:
            self.metrics.imds_requests.labels(endpoint_label, "error").inc()
            self.metrics.imds_duration.labels(endpoint_label).observe(self.clock.monotonic() - start)
            kind = "timed out" if isinstance(exc, requests.Timeout) else "connection failed"
            raise ImdsUnavailable(f"IMDS {kind}: {type(exc).__name__}: {exc}") from exc
        self.metrics.imds_requests.labels(endpoint_label, str(response.status_code)).inc()
        self.metrics.imds_duration.labels(endpoint_label).observe(self.clock.monotonic() - start)
        return response

    def _raise_for(self, response: requests.Response) -> None:
        status = response.status_code
        if 200 <= status < 300 or status == 304:
            return
        body = response.text[:500]
        retry_after = parse_retry_after(response.headers.get("Retry-After"), self.clock.now())
        if status in (400, 405):
            raise ImdsRequestRejected(f"IMDS rejected the request ({status})", status, body)
        raise ImdsUnavailable(f"IMDS answered {status}", status, body, retry_after)

    def get_document(self) -> PollResult:
        """Poll Scheduled Events once; raises ImdsError on any failure (never retries)."""
        headers = {"If-None-Match": self._etag} if self._etag else None
        timeout = self.timeout if self._answered else max(self.timeout, self.first_timeout)
        start = self.clock.monotonic()
        response = self._request("scheduledevents", "GET", SCHEDULED_EVENTS_PATH,
                                 params={"api-version": self.api_version}, timeout=timeout, headers=headers)
        self._raise_for(response)
        self._answered = True
        duration = self.clock.monotonic() - start
        if response.status_code == 304:
            return PollResult(None, True, duration)
        content_type = response.headers.get("Content-Type", "")
        if "json" not in content_type.lower():
            raise ImdsUnavailable(f"IMDS answered {response.status_code} with Content-Type {content_type!r}, "
                                  "not JSON (is a proxy in the path?)", response.status_code, response.text[:200])
        if self._last is not None and response.content == self._last[0]:  # nearly every poll at 1 Hz
            return PollResult(None, True, duration)
        try:
            document = parse_document(response.json(), self._last[1] if self._last else None)
        except (ValueError, DocumentError) as exc:
            self.metrics.documents_malformed.inc()
            raise ImdsUnavailable(f"malformed Scheduled Events document: {exc}", response.status_code,
                                  response.text[:200]) from exc
        self._etag = response.headers.get("ETag") or None
        self._last = (response.content, document)
        return PollResult(document, False, duration)

    def approve(self, event_ids: list[str]) -> None:
        """POST StartRequests for `event_ids`; raises ImdsError unless IMDS answers 2xx."""
        response = self._request("approve", "POST", SCHEDULED_EVENTS_PATH, params={"api-version": self.api_version},
                                 timeout=self.timeout, json_body={"StartRequests": [{"EventId": e} for e in event_ids]})
        self._raise_for(response)

    def compute_identity(self) -> Identity:
        """This VM's `compute.name` (what Resources lists), computer name and scale set; raises ImdsError."""
        response = self._request("compute", "GET", COMPUTE_PATH, params={"api-version": self.compute_api_version},
                                 timeout=max(self.timeout, 10.0))
        self._raise_for(response)
        try:
            return identity_from_compute(jsonsafe.loads(response.content, max_bytes=COMPUTE_MAX_BYTES))
        except ValueError as exc:
            raise ImdsUnavailable(f"compute metadata is not usable: {exc}", response.status_code) from exc


def is_transient(exc: BaseException) -> bool:
    """Whether retrying may help (tenacity predicate): anything but a rejected request."""
    return isinstance(exc, ImdsError) and not isinstance(exc, ImdsRequestRejected)
