"""A fault-injecting HTTP proxy between maintd's store backend and Azurite, on 127.0.0.1 only (standard library).

Point an agent's connection string at `proxy.url` instead of Azurite's (`proxy.connection_string()`); the
proxy forwards every request to Azurite and records it (`proxy.seen`). A test adds `Rule`s at run time,
each matching a request pattern (method, a path regex, a query part, request metadata such as
`x-ms-meta-state: claimed`) for `count` requests (None: until removed), and only before the monotonic
instant `until` when one is set (a fault that ends by itself):

    lose      forward the request (the write lands), then reset the connection instead of answering
    throttle  answer 503 ServerBusy with `Retry-After: <retry_after>` without forwarding
    fail      answer `status` (500 InternalError) without forwarding: the store failing this VM's requests
    latency   hold the request `delay` seconds, then forward it
    rewrite   forward it and pass the answer's body through `edit` (a listing with an odd record)
    pad       forward a listing and pad its answer to `size` bytes with blobs of its folder (50 MB)

Shared Key signatures cover the path and the x-ms-* headers, not the Host, so forwarding keeps them valid.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                 "proxy-connection", "content-length", "host"})


@dataclass(frozen=True)
class Request:
    """One request the proxy received, what it did with it and when (time.monotonic)."""

    at: float
    method: str
    path: str
    query: str
    meta: dict[str, str]
    status: int | None
    fault: str | None
    retry_after: float | None = None

    @property
    def blob(self) -> str:
        """The blob (or container) path after the account and container: `events/<id>/approval`."""
        parts = self.path.split("/", 3)
        return parts[3] if len(parts) > 3 else ""


@dataclass
class Rule:
    """One fault for the requests it matches (see the module docstring for the kinds)."""

    kind: str
    method: str | None = None
    path: str | None = None
    query: str | None = None
    meta: dict[str, str] = field(default_factory=dict)
    count: int | None = None
    delay: float = 0.0
    retry_after: float = 2.0
    size: int = 50 << 20
    edit: Callable[[bytes], bytes] | None = None
    status: int = 500
    until: float | None = None
    fired: int = 0

    def matches(self, method: str, path: str, query: str, meta: dict[str, str]) -> bool:
        if self.count is not None and self.fired >= self.count:
            return False
        if self.until is not None and time.monotonic() >= self.until:
            return False
        return ((self.method is None or self.method == method)
                and (self.path is None or re.search(self.path, path) is not None)
                and (self.query is None or self.query in query)
                and all(meta.get(k) == v for k, v in self.meta.items()))


class StoreProxy:
    """The proxy: `url` is what the agents use as their blob endpoint."""

    def __init__(self, upstream: str, account: str) -> None:
        split = urlsplit(upstream)
        assert split.hostname == "127.0.0.1" and split.scheme == "http", "loopback HTTP only"
        self.upstream = (split.hostname, split.port or 80)
        self.account = account
        self.rules: list[Rule] = []
        self.seen: list[Request] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/{account}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def connection_string(self, key: str) -> str:
        return f"DefaultEndpointsProtocol=http;AccountName={self.account};AccountKey={key};BlobEndpoint={self.url};"

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def requests(self) -> list[Request]:
        """What was received so far, in order."""
        with self._lock:
            return list(self.seen)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _take(self, method: str, path: str, query: str, meta: dict[str, str]) -> Rule | None:
        with self._lock:
            rule = next((r for r in self.rules if r.matches(method, path, query, meta)), None)
            if rule is not None:
                rule.fired += 1
            return rule

    def _note(self, request: Request) -> None:
        with self._lock:
            self.seen.append(request)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # the base class's name
                pass

            def _any(self) -> None:
                at = time.monotonic()
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path, _, query = self.path.partition("?")
                meta = {k.lower()[len("x-ms-meta-"):]: v for k, v in self.headers.items()
                        if k.lower().startswith("x-ms-meta-")}
                rule = proxy._take(self.command, path, query, meta)
                kind = rule.kind if rule else None
                if rule is not None and kind == "throttle":
                    proxy._note(Request(at, self.command, path, query, meta, 503, kind, rule.retry_after))
                    payload = (b'<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code><Message>'
                               b"The server is busy.</Message></Error>")
                    self._answer(503, [("Content-Type", "application/xml"), ("x-ms-error-code", "ServerBusy"),
                                       ("Retry-After", f"{rule.retry_after:g}")], payload)
                    return
                if rule is not None and kind == "fail":
                    proxy._note(Request(at, self.command, path, query, meta, rule.status, kind))
                    payload = (b'<?xml version="1.0" encoding="utf-8"?><Error><Code>InternalError</Code><Message>'
                               b"The server encountered an internal error.</Message></Error>")
                    self._answer(rule.status, [("Content-Type", "application/xml"),
                                               ("x-ms-error-code", "InternalError")], payload)
                    return
                if rule is not None and kind == "latency":
                    time.sleep(rule.delay)
                status, headers, answer = self._forward(body)
                proxy._note(Request(at, self.command, path, query, meta, status, kind))
                if rule is not None and kind == "lose":
                    # the write landed; the client sees its connection reset instead of the answer
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                if rule is not None and kind == "rewrite" and rule.edit is not None:
                    answer = rule.edit(answer)
                if rule is not None and kind == "pad" and status == 200:
                    self._padded(status, headers, answer, path, query, rule.size)
                    return
                self._answer(status, headers, answer)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _any

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body if body or self.command != "GET" else None,
                                 headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                    return answer.status, [(k, v) for k, v in answer.getheaders() if k.lower() not in HOP], data
                finally:
                    conn.close()

            def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response_only(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _padded(self, status: int, headers: list[tuple[str, str]], answer: bytes, path: str,
                        query: str, size: int) -> None:
                head, sep, tail = answer.rpartition(b"</Blobs>")
                if not sep:
                    self._answer(status, headers, answer)
                    return
                prefix = re.search(r"prefix=([^&]*)", query)
                folder = (prefix.group(1) if prefix else "").replace("%2F", "/").replace("%2f", "/")
                chunks = list(_padding(folder, size - len(answer)))
                self.send_response_only(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(head) + sum(map(len, chunks)) + len(sep) + len(tail)))
                self.end_headers()
                self.wfile.write(head)
                for chunk in chunks:
                    self.wfile.write(chunk)
                self.wfile.write(sep + tail)

        return Handler


def _padding(folder: str, size: int) -> Iterator[bytes]:
    """Listed blobs of `folder` worth about `size` bytes, each a marker the protocol did not write."""
    done, n = 0, 0
    while done < size:
        batch = b"".join(
            (f"<Blob><Name>{folder}vm/ghost-{i:07d}</Name><Properties>"
             "<Last-Modified>Fri, 27 Nov 2026 00:00:00 GMT</Last-Modified><Etag>0x8DD0000000000</Etag>"
             "<Content-Length>0</Content-Length><BlobType>BlockBlob</BlobType></Properties><Metadata>"
             f"<maintd>1</maintd><kind>vm</kind><event>x</event><vm>ghost-{i:07d}</vm><state>ready</state>"
             "<health>ok</health></Metadata></Blob>").encode() for i in range(n, n + 1000))
        n += 1000
        done += len(batch)
        yield batch


def strip_element(blob: str, element: str) -> Callable[[bytes], bytes]:
    """An `edit` that removes `<element>...</element>` from the listed blob whose name ends with `blob`."""
    pattern = re.compile(rb"(<Blob><Name>[^<]*" + re.escape(blob.encode()) + rb"</Name>.*?)<"
                         + element.encode() + rb"(?: ?/>|>.*?</" + element.encode() + rb">)(.*?</Blob>)", re.S)
    return lambda body: pattern.sub(rb"\1\2", body)


def replace_element(blob: str, element: str, value: str) -> Callable[[bytes], bytes]:
    """An `edit` that sets `<element>` of the listed blob whose name ends with `blob` to raw XML `value`."""
    pattern = re.compile(rb"(<Blob><Name>[^<]*" + re.escape(blob.encode()) + rb"</Name>.*?<" + element.encode()
                         + rb">).*?(</" + element.encode() + rb">)", re.S)
    return lambda body: pattern.sub(lambda m: m.group(1) + value.encode() + m.group(2), body)
