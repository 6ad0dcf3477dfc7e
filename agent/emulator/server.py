"""One HTTP server per emulated VM: IMDS's wire format, its request validation, its rate limit,
injected faults, and a small admin API.

Validation follows IMDS's order (shared/research/imds.md §9): X-Forwarded-For, the Metadata
header, duplicate query parameters, api-version, method, then the 5 requests/s token bucket.
"""

from __future__ import annotations

import http.server
import json
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from agent.emulator.model import API_VERSIONS, NEWEST_VERSIONS

if TYPE_CHECKING:
    from agent.emulator import Emulator

SE_PATH = "/metadata/scheduledevents"
COMPUTE_PATH = "/metadata/instance/compute"
INSTANCE_VERSIONS = ("2017-03-01", "2017-04-02", "2017-08-01", "2017-12-01", "2018-02-01", "2018-04-02",
                     "2018-10-01", "2019-02-01", "2019-03-11", "2019-04-30", "2019-06-01", "2019-06-04",
                     "2019-08-01", "2019-08-15", "2019-11-01", "2020-06-01", "2020-07-15", "2020-09-01",
                     "2020-10-01", "2020-12-01", "2021-01-01", "2021-02-01", "2021-03-01", "2021-05-01",
                     "2021-10-01", "2021-11-01", "2021-11-15", "2021-12-13", "2023-07-01")
ERR_METADATA = {"error": "Bad request. Required metadata header not specified"}
ERR_VERSION = {"error": "Bad request. api-version is invalid or was not specified in the request. "
                        "For more information refer to aka.ms/azureimds", "newest-versions": NEWEST_VERSIONS}
ERR_DUPLICATE = {"error": "Bad request. Query parameters should not be repeated"}
ERR_FORWARDED = {"error": "Bad request. Requests with X-Forwarded-For header are not allowed"}
STATUS_BODIES = {404: "Not found", 410: "Gone", 429: "Too many requests", 500: "Internal server error",
                 503: "Service unavailable"}
PROXY_504 = (b"<html><head><title>504 Gateway Timeout</title></head><body><h1>Gateway Timeout</h1>"
             b"<p>The proxy server did not receive a timely response from the upstream server.</p></body></html>")
FAULT_KINDS = ("latency", "hang", "status", "proxy_504", "malformed", "wrong_content_type", "reset",
               "reset_mid_body", "first_call_delay")
MAX_RECORDED = 200_000


@dataclass
class Fault:
    """One injected misbehaviour; `count` requests (None: all) until `until` (emulator monotonic; None: forever)."""

    kind: str
    vm: str | None = None
    path: str | None = None
    count: int | None = None
    until: float | None = None
    status: int = 503
    delay: float = 1.0
    retry_after: str | None = None
    fired: int = field(default=0)

    def applies(self, vm: str, path: str, now: float) -> bool:
        if self.vm is not None and self.vm != vm:
            return False
        if self.path is not None and not path.startswith(self.path):
            return False
        if self.until is not None and now >= self.until:
            return False
        return self.count is None or self.fired < self.count


class TokenBucket:
    """IMDS's per-VM limit: `rate` requests per second, bursts up to `rate`."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate, self.tokens, self.at = rate, rate, now
        self.lock = threading.Lock()

    def take(self, now: float) -> bool:
        with self.lock:
            self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                return True
            return False


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "VmServer"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Quiet: every request is recorded instead."""

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def _send(self, status: int, body: bytes, content_type: str = "application/json; charset=utf-8",
              extra: dict[str, str] | None = None) -> None:
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Server", "Microsoft-IIS/10.0")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj, separators=(",", ":")).encode(), extra=extra)

    def _handle(self, method: str) -> None:
        emu = self.server.emulator
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if 0 < length <= 1 << 20 else b""
        self._status = 0
        try:
            if url.path.startswith("/admin/"):
                self._admin(method, url.path[len("/admin/"):], body)
            else:
                self._imds(method, url.path, url.query, body)
        finally:
            emu.record(self.server.vm, method, url.path, url.query, dict(self.headers), body, self._status)

    # --- IMDS --------------------------------------------------------------------------------

    def _imds(self, method: str, path: str, query: str, body: bytes) -> None:
        emu, vm = self.server.emulator, self.server.vm
        if self._fault(path):
            return
        if "X-Forwarded-For" in self.headers:
            return self._json(400, ERR_FORWARDED)
        if (self.headers.get("Metadata") or "").strip().lower() != "true":
            return self._json(400, ERR_METADATA)
        pairs = parse_qsl(query, keep_blank_values=True)
        names = [k for k, _ in pairs]
        if len(names) != len(set(names)):
            return self._json(400, ERR_DUPLICATE)
        params = dict(pairs)
        version = params.get("api-version", "")
        if path.rstrip("/") == SE_PATH:
            if version not in API_VERSIONS:
                return self._json(400, ERR_VERSION)
            if method not in ("GET", "POST"):
                return self._json(405, {"error": "Method not allowed"})
            if not emu.bucket(vm).take(emu.clock.monotonic()):
                return self._json(429, {"error": "Too many requests"})
            return self._scheduled_events(method, version, body)
        if path.rstrip("/").startswith(COMPUTE_PATH) or path.rstrip("/") == "/metadata/instance":
            if version not in INSTANCE_VERSIONS:
                return self._json(400, ERR_VERSION)
            if method != "GET":
                return self._json(405, {"error": "Method not allowed"})
            if not emu.bucket(vm).take(emu.clock.monotonic()):
                return self._json(429, {"error": "Too many requests"})
            return self._instance(path.rstrip("/"), params)
        if path == "/metadata/versions":
            return self._json(200, {"apiVersions": list(INSTANCE_VERSIONS)})
        return self._json(404, {"error": "Not found"})

    def _scheduled_events(self, method: str, version: str, body: bytes) -> None:
        emu, vm = self.server.emulator, self.server.vm
        if method == "GET":
            doc = emu.model.document(vm, version)
            if emu.etag:
                tag = f'"{vm}-{doc["DocumentIncarnation"]}-{emu.model.generation}"'
                if self.headers.get("If-None-Match") == tag:
                    return self._send(304, b"", extra={"ETag": tag})
                return self._json(200, doc, {"ETag": tag})
            return self._json(200, doc)
        try:
            data = json.loads(body or b"null")
            ids = [r["EventId"] for r in data["StartRequests"]]
            if not ids or not all(isinstance(i, str) and i for i in ids):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return self._json(400, {"error": "Bad request. The request body is malformed: expected "
                                             '{"StartRequests": [{"EventId": "..."}]}'})
        status, answer = emu.model.approve(vm, ids)
        self._json(status, answer)

    def _instance(self, path: str, params: dict[str, str]) -> None:
        vm = self.server.vm
        compute = {"name": vm, "location": "westeurope", "vmId": self.server.vm_id, "vmSize": "Standard_D2s_v5",
                   "osType": "Linux", "resourceGroupName": "maintd-emulator", "vmScaleSetName": "",
                   "resourceId": f"/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/"
                                 f"maintd-emulator/providers/Microsoft.Compute/virtualMachines/{vm}"}
        if path == "/metadata/instance":
            return self._json(200, {"compute": compute, "network": {"interface": []}})
        leaf = path[len(COMPUTE_PATH):].strip("/")
        if not leaf:
            return self._json(200, compute)
        if leaf not in compute:
            return self._json(404, {"error": "Not found"})
        if params.get("format") != "text":
            return self._json(400, {"error": "Bad request. Leaf nodes require format=text"})
        self._send(200, str(compute[leaf]).encode(), "text/plain; charset=utf-8")

    def _fault(self, path: str) -> bool:
        """Act out an injected fault; True when it has answered (or dropped) the request."""
        emu = self.server.emulator
        fault = emu.take_fault(self.server.vm, path)
        if fault is None:
            return False
        kind = fault.kind
        if kind in ("latency", "first_call_delay"):
            time.sleep(emu.model.real(fault.delay))
            return False
        if kind == "hang":
            emu.hang_released.wait(600)
            self.close_connection = True
            return True
        if kind == "status":
            extra = {"Retry-After": fault.retry_after} if fault.retry_after else None
            self._json(fault.status, {"error": STATUS_BODIES.get(fault.status, "Error")}, extra)
            return True
        if kind == "proxy_504":
            self._send(504, PROXY_504, "text/html")
            return True
        if kind == "malformed":
            self._send(200, b'{"DocumentIncarnation": 7, "Events": [{"EventId": "A1B2", "EventTy')
            return True
        if kind == "wrong_content_type":
            self._send(200, b"<html><body>Welcome</body></html>", "text/html; charset=utf-8")
            return True
        self.close_connection = True
        self._status = -1
        if kind == "reset_mid_body":
            head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
                    b"Content-Length: 400\r\n\r\n" + b'{"DocumentIncarnation": 1, "Events": [')
            self.wfile.write(head)
            self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return True

    # --- admin -------------------------------------------------------------------------------

    def _admin(self, method: str, route: str, body: bytes) -> None:
        emu = self.server.emulator
        if self.client_address[0] not in ("127.0.0.1", "::1"):
            return self._json(403, {"error": "the admin API answers loopback only"})
        try:
            data = json.loads(body) if body else {}
            self._json(*emu.admin(method, route.strip("/"), data, self.server.vm))
        except (ValueError, KeyError, TypeError) as exc:
            self._json(400, {"error": str(exc)})


class VmServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """The IMDS endpoint of one emulated VM."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, host: str, port: int, vm: str, vm_id: str, emulator: "Emulator") -> None:
        self.vm, self.vm_id, self.emulator = vm, vm_id, emulator
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def recorded(vm: str, method: str, path: str, query: str, headers: dict[str, str], body: bytes, status: int,
             wall: float, mono: float) -> dict[str, Any]:
    """A recorded request as tests read it (JSON-friendly)."""
    return {"vm": vm, "method": method, "path": path, "query": query, "headers": headers,
            "body": body.decode("utf-8", "replace"), "status": status, "time": wall, "mono": mono}
