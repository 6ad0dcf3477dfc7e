"""The only code that talks to Azure Blob Storage: the store coordination backend's thin I/O edge.

Five requests, each counted by operation and outcome (and, for the budget, a small record's body read
— also with If-None-Match on the ETag last seen, a 304 `Unchanged` counted `not_modified` — and written with a
condition): put a marker (unconditional: a VM writes only
its own), list an event's folder with metadata (and the store's Date; one request per PAGE blobs), create a record with
If-None-Match: * (the claim), replace one with If-Match: <etag>, read one record. What the records
mean is `store_protocol`'s business; here every failure becomes a `StoreError` with a short outcome
label and a readable reason, and an ETag condition that did not hold is an answer (None), not an
error.

`azure-storage-blob` (the `maintd[azure]` extra) is imported only when this module is, which only the
`azure_blob` backend does. Its requests go through `requests`, which honours HTTPS_PROXY and
REQUESTS_CA_BUNDLE; the managed-identity token (`identity_token`) never does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import requests
from azure.core import MatchConditions
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.blob import ContainerClient, LinearRetry

from agent.coordination.store.store_protocol import RETRY_AFTER_MAX, Item, StoreError, Unchanged
from agent.net.httpdates import parse_http_date, retry_after

CONNECT_TIMEOUT, READ_TIMEOUT = 5.0, 10.0
"""Seconds to connect to the store and to wait for one answer."""
RETRIES, RETRY_BACKOFF = 2, 1
"""The SDK's own retries of one request, 1 s apart (its default waits 15 s, then 18 s); maintd retries the rest."""
PAGE, MAX_PAGES = 250, 8
"""Blobs per page of a listing, and pages read (an event names at most 1000 VMs): a page of 5000 costs
the SDK about 15 MB while it turns the XML into objects; 250 keep a 1000-VM listing near 5 MB."""
MAX_ANSWER_BYTES = 4 * 1024 * 1024
"""Bytes any one store answer may have (a page of 250 protocol records is about 0.3 MB). PAGE and MAX_PAGES
bound what is asked; this and the entry count bound what comes back, read before requests keeps it whole."""
CHUNK = 64 * 1024

Expected = tuple[type[Exception], ...]
Count = Callable[[str, str], None]
"""Called once per request with (operation, outcome): the metric `maintd_store_requests_total`."""


@dataclass(frozen=True)
class Settings:
    """Where the store is and how to authenticate: a token credential or a connection string."""

    account_url: str
    container: str
    credential: Any = None
    connection_string: str | None = None


def outcome_of(exc: BaseException) -> StoreError:
    """The metric label and a readable reason for a failed request."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, ClientAuthenticationError) and getattr(exc, "status_code", None) is None:
        return StoreError("token_failed", f"no token for the store: {str(exc)[:300]}")
    status = exc.status_code if isinstance(exc, HttpResponseError) else None
    if status is not None:
        code = getattr(exc, "error_code", None) or ""
        label = ("denied" if status in (401, 403) else "not_found" if status == 404 else
                 "throttled" if status in (429, 503) else "server_error" if status >= 500 else "refused")
        hint = {"denied": " (does this VM's identity have Storage Blob Data Contributor on the container?)",
                "not_found": " (does the container exist?)"}.get(label, "")
        return StoreError(label, f"store answered {status} {code}{hint}")
    if isinstance(exc, (ServiceRequestError, ServiceResponseError, OSError)):
        return StoreError("unreachable", f"store unreachable: {str(exc)[:300]}")
    return StoreError("error", f"{type(exc).__name__}: {str(exc)[:300]}")


class NotModified(Exception):
    """A conditional read's 304 (If-None-Match held): an answer, not a failure."""


def _server_time(headers: Mapping[str, str], fallback: datetime) -> datetime:
    return parse_http_date(headers.get("Date")) or fallback


def bounded_answer(response: requests.Response, **_: Any) -> requests.Response:
    """A response hook on the store's requests session, run before requests reads the body: read it here, at
    most MAX_ANSWER_BYTES, and a listing page of at most PAGE blobs; else drop the connection and fail the
    request (`too_large`, retried by maintd with backoff; never half a listing). A throttling answer (429, 503)
    with a Retry-After ends the request here too, so the SDK does not ask again after its own 1 s: maintd
    waits what the store asked for (`StoreError.retry_after`)."""
    if response.status_code in (429, 503):
        wait = retry_after(response.headers.get("Retry-After"), datetime.now(UTC), RETRY_AFTER_MAX)
        if wait is not None:
            response.close()
            raise StoreError("throttled", f"store answered {response.status_code} "
                                          f"{response.headers.get('x-ms-error-code', '')}, Retry-After {wait:g}s",
                             retry_after=wait)
    body = bytearray()
    for chunk in response.raw.stream(CHUNK, decode_content=True):
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            response.close()
            raise StoreError("too_large", f"a store answer over {MAX_ANSWER_BYTES // 2**20} MiB: not read further")
    entries = body.count(b"<Blob>") if "comp=list" in (response.request.url or "") else 0
    if entries > PAGE:
        response.close()
        raise StoreError("too_large", f"a listing page of {entries} blobs, asked for at most {PAGE}")
    response._content = bytes(body)  # what requests would have read itself
    setattr(response, "_content_consumed", True)  # noqa: B010 - private in requests, unknown to its stubs
    return response


def _session() -> requests.Session:
    session = requests.Session()
    session.hooks["response"].append(bounded_answer)
    return session


class BlobStore:
    """One container; thread-safe (the SDK client is), each call one request (plus the SDK's retries)."""

    def __init__(self, container: ContainerClient, count: Count) -> None:
        self.container = container
        self.count = count

    @classmethod
    def open(cls, settings: Settings, count: Count) -> BlobStore:
        """A store over the SDK's client: connection string (Azurite, tests) or a token credential."""
        options: dict[str, Any] = {"connection_timeout": CONNECT_TIMEOUT, "read_timeout": READ_TIMEOUT,
                                   "session": _session(),
                                   "retry_policy": LinearRetry(backoff=RETRY_BACKOFF, random_jitter_range=0,
                                                               retry_total=RETRIES)}
        if settings.connection_string is not None:
            client = ContainerClient.from_connection_string(settings.connection_string, settings.container, **options)
        else:
            client = ContainerClient(settings.account_url, settings.container, credential=settings.credential,
                                     **options)
        return cls(client, count)

    def _call(self, op: str, fn: Callable[[], Any], expected: Expected = (), label: str = "conflict") -> Any:
        """Run one request; a failure of kind `expected` (a condition that did not hold) is returned, not raised."""
        try:
            result = fn()
        except Exception as exc:
            if isinstance(exc, expected):
                self.count(op, "not_modified" if isinstance(exc, NotModified) else label)
                return exc
            error = outcome_of(exc)
            self.count(op, error.outcome)
            raise error from None
        self.count(op, "ok")
        return result

    def _blob(self, name: str) -> Any:
        return self.container.get_blob_client(name)

    def put(self, name: str, metadata: Mapping[str, str]) -> str | None:
        """Write a blob whoever wrote it before (a VM's own marker): its new ETag (None if the answer had none)."""
        result = self._call("put", lambda: self._blob(name).upload_blob(b"", metadata=dict(metadata), overwrite=True))
        etag = result.get("etag") if isinstance(result, dict) else None
        return etag if isinstance(etag, str) else None

    def list_folder(self, prefix: str) -> tuple[list[Item], datetime]:
        """Every blob under `prefix` with its metadata, and the store's clock when it answered."""
        headers: dict[str, str] = {}

        def hook(response: Any) -> None:
            headers.update(response.http_response.headers)

        def listing() -> list[Item]:
            pages = self.container.list_blobs(name_starts_with=prefix, include=["metadata"],
                                              results_per_page=PAGE, raw_response_hook=hook).by_page()
            items: list[Item] = []
            for n, page in enumerate(itertools.islice(pages, MAX_PAGES)):
                if n:
                    self.count("list", "ok")  # each further page is one more request (the first is counted below)
                items += [Item(b.name, b.metadata or {}, b.etag, b.last_modified) for b in itertools.islice(page, PAGE)]
            return items

        items = self._call("list", listing)
        return items, _server_time(headers, datetime.now(UTC))

    def create(self, name: str, metadata: Mapping[str, str]) -> str | None:
        """Create a blob only if none exists (If-None-Match: *): its ETag, or None when one already existed."""
        result = self._call("create", lambda: self._blob(name).upload_blob(
            b"", metadata=dict(metadata), overwrite=False), (ResourceExistsError,))
        return None if isinstance(result, BaseException) else str(result["etag"])

    def replace(self, name: str, metadata: Mapping[str, str], etag: str) -> str | None:
        """Rewrite a blob only if it is still at `etag` (If-Match): the new ETag, or None when it changed."""
        result = self._call("replace", lambda: self._blob(name).upload_blob(
            b"", metadata=dict(metadata), overwrite=True, etag=etag,
            match_condition=MatchConditions.IfNotModified), (ResourceModifiedError, ResourceNotFoundError))
        return None if isinstance(result, BaseException) else str(result["etag"])

    def read(self, name: str) -> tuple[dict[str, str], str] | None:
        """One blob's metadata and ETag; None when there is no such blob."""
        result = self._call("read", lambda: self._blob(name).get_blob_properties(),
                            (ResourceNotFoundError,), "absent")
        return None if isinstance(result, BaseException) else (dict(result.metadata or {}), str(result.etag))

    def read_body(self, name: str) -> tuple[bytes, str, datetime] | None:
        """A small record's body, its ETag and the store's clock when it answered; None when there is none."""
        headers: dict[str, str] = {}

        def hook(response: Any) -> None:
            headers.update(response.http_response.headers)

        def download() -> tuple[bytes, str]:
            stream = self._blob(name).download_blob(raw_response_hook=hook)
            return stream.readall(), str(stream.properties.etag)

        result = self._call("read", download, (ResourceNotFoundError,), "absent")
        if isinstance(result, BaseException):
            return None
        return result[0], result[1], _server_time(headers, datetime.now(UTC))

    def read_if_changed(self, name: str, etag: str) -> tuple[bytes, str, datetime] | Unchanged | None:
        """`read_body` with If-None-Match: `etag`: `Unchanged` (a 304, no body) while the record is still at it."""
        headers: dict[str, str] = {}

        def hook(response: Any) -> None:
            headers.update(response.http_response.headers)

        def download() -> tuple[bytes, str]:
            try:
                stream = self._blob(name).download_blob(etag=etag, match_condition=MatchConditions.IfModified,
                                                        raw_response_hook=hook)
            except HttpResponseError as exc:  # the SDK's own mapping gives ResourceNotModifiedError or its base
                if exc.status_code == 304:
                    raise NotModified() from None
                raise
            return stream.readall(), str(stream.properties.etag)

        result = self._call("read", download, (ResourceNotFoundError, NotModified), "absent")
        date = _server_time(headers, datetime.now(UTC))
        if isinstance(result, NotModified):
            return Unchanged(etag, date)
        return None if isinstance(result, BaseException) else (result[0], result[1], date)

    def write_body(self, name: str, body: bytes, etag: str | None) -> str | None:
        """Create a small record (etag None: If-None-Match: *) or rewrite it (If-Match: etag): its new ETag, or
        None when the condition did not hold (someone else wrote first)."""
        if etag is None:
            result = self._call("create", lambda: self._blob(name).upload_blob(body, overwrite=False),
                                (ResourceExistsError,))
        else:
            result = self._call("replace", lambda: self._blob(name).upload_blob(
                body, overwrite=True, etag=etag, match_condition=MatchConditions.IfNotModified),
                (ResourceModifiedError, ResourceNotFoundError))
        return None if isinstance(result, BaseException) else str(result["etag"])

    def close(self) -> None:
        self.container.close()
