"""One HTTP server per emulated VM: IMDS's wire format and request validation, its rate limit,
injected faults (acted out by `answering`), and the loopback-only admin API under `/admin/`.

Validation follows IMDS's order (shared/research/imds.md §9): X-Forwarded-For, the Metadata header,
duplicate query parameters, api-version, method, then the per-VM token bucket. HTTP/1.1 keep-alive
works (every answer carries a right Content-Length), nothing is logged per request (every request is
recorded instead), and `close()` ends open keep-alive connections too.
"""

from __future__ import annotations

import hashlib
import http.server
import ipaddress
import json
import selectors
import socket
import struct
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any, TypedDict
from urllib.parse import SplitResult, parse_qsl, urlsplit

from agent.emulator.admin import Host, admin
from agent.emulator.answering import FaultyAnswers
from agent.emulator.faults import error_body
from agent.emulator.identity import IDENTITY_PATH, IDENTITY_VERSIONS, token_answer
from agent.emulator.model import API_VERSIONS, NEWEST_VERSIONS, UnknownEventError

SE_PATH = "/metadata/scheduledevents"
INSTANCE_PATH = "/metadata/instance"
COMPUTE_PATH = "/metadata/instance/compute"
VERSIONS_PATH = "/metadata/versions"
INSTANCE_VERSIONS = ("2017-03-01", "2017-04-02", "2017-08-01", "2017-10-01", "2017-12-01", "2018-02-01",
                     "2018-04-02", "2018-10-01", "2019-02-01", "2019-03-11", "2019-04-30", "2019-06-01",
                     "2019-06-04", "2019-08-01", "2019-08-15", "2019-11-01", "2020-06-01", "2020-07-15",
                     "2020-09-01", "2020-10-01", "2020-12-01", "2021-01-01", "2021-02-01", "2021-03-01",
                     "2021-05-01", "2021-10-01", "2021-11-01", "2021-11-15", "2021-12-13", "2023-07-01",
                     "2023-11-15", "2024-03-15", "2024-07-17", "2025-04-07")
"""The IMDS instance api-versions (a separate list from Scheduled Events')."""
ERR_FORWARDED = {"error": "Bad request. Requests with X-Forwarded-For header are not allowed"}
ERR_METADATA = {"error": "Bad request. Required metadata header not specified"}
ERR_DUPLICATE = {"error": "Bad request. Query parameters should not be repeated"}
ERR_VERSION = {"error": "Bad request. api-version is invalid or was not specified in the request. "
                        "For more information refer to aka.ms/azureimds", "newest-versions": NEWEST_VERSIONS}
ERR_BODY = {"error": 'Bad request. The request body is malformed: expected {"StartRequests": [{"EventId": "..."}]}'}
ERR_LEAF = {"error": "Bad request. Leaf nodes require format=text"}
MAX_BODY = 64 * 1024


class OsProfile(TypedDict):
    """`compute.osProfile`."""

    adminUsername: str
    computerName: str
    disablePasswordAuthentication: str


class Compute(TypedDict):
    """`compute` metadata: every primitive a string, as IMDS sends it."""

    name: str
    location: str
    vmId: str
    vmSize: str
    osType: str
    zone: str
    vmScaleSetName: str
    platformFaultDomain: str
    osProfile: OsProfile
    platformUpdateDomain: str
    resourceGroupName: str
    subscriptionId: str
    resourceId: str


def uniform_names(vm: str) -> tuple[str, str]:
    """(vmScaleSetName, osProfile.computerName) Azure gives a VM: `web_3` is instance 3 of Uniform scale set
    `web`, computer name `web` + the id in base 36 on 6 digits (`web000003`); any other name is a plain VM."""
    scale_set, sep, number = vm.rpartition("_")
    if not sep or not scale_set or not number.isdigit():
        return "", vm
    n, digits = int(number), ""
    while True:
        n, d = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[d] + digits
        if not n:
            break
    return scale_set, scale_set + digits.rjust(6, "0")


class TokenBucket:
    """IMDS's per-VM limit: `rate` requests per second, bursts up to `rate` (at least one)."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate, self.capacity, self.tokens, self.at = rate, max(rate, 1.0), max(rate, 1.0), now
        self.lock = threading.Lock()

    def take(self, now: float) -> bool:
        with self.lock:
            self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                return True
            return False


def start_requests(body: bytes) -> list[str] | None:
    """The EventIds of a StartRequests body; None when it is malformed (missing, empty, wrong types)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    requests = data.get("StartRequests") if isinstance(data, dict) else None
    if not isinstance(requests, list) or not requests:
        return None
    ids = [r.get("EventId") if isinstance(r, dict) else None for r in requests]
    return [i for i in ids if isinstance(i, str) and i] if all(isinstance(i, str) and i for i in ids) else None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class _Handler(FaultyAnswers):
    protocol_version = "HTTP/1.1"
    server_version = "maintd-imds-emulator"
    disable_nagle_algorithm = True  # headers and body go out as separate writes: no 40 ms delayed-ACK stalls
    server: VmServer

    def log_message(self, format: str, *args: Any) -> None:  # the stdlib's signature
        """Quiet: every request is recorded instead."""

    def version_string(self) -> str:
        return self.server_version

    # --- every request -----------------------------------------------------------------------

    def _handle(self) -> None:
        emu = self.server.emulator
        self._record = None
        url = urlsplit(self.path)
        body = self._body()
        if body is None:
            return
        emu.tick()
        if url.path.startswith("/admin/"):
            return self._admin(url, body)
        self._record = emu.record(self.server.vm, self.command, url.path, url.query, dict(self.headers.items()), body)
        if self._faults(url, body):
            self._imds(url, body)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _handle

    def _body(self) -> bytes | None:
        """The request body; None (answered, connection closing) when it cannot be framed or is too big."""
        if "Transfer-Encoding" in self.headers:
            self._json(411, {"error": "Length Required"}, {"Connection": "close"})
            return None
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self._json(413 if length > MAX_BODY else 400, {"error": "Bad request. Bad Content-Length"},
                       {"Connection": "close"})
            return None
        return self.rfile.read(length) if length else b""

    # --- IMDS --------------------------------------------------------------------------------

    def _imds(self, url: SplitResult, body: bytes) -> None:
        if "X-Forwarded-For" in self.headers:
            return self._json(400, ERR_FORWARDED)
        if (self.headers.get("Metadata") or "").strip().lower() != "true":
            return self._json(400, ERR_METADATA)
        pairs = parse_qsl(url.query, keep_blank_values=True)
        if len({k for k, _ in pairs}) != len(pairs):
            return self._json(400, ERR_DUPLICATE)
        params = dict(pairs)
        path = url.path.rstrip("/")
        route = self._route(path)
        if route is None:
            return self._json(404, error_body(404))
        versions, methods, answer = route
        if versions and params.get("api-version") not in versions:
            return self._json(400, ERR_VERSION)
        if self.command not in methods:
            return self._json(405, error_body(405), {"Allow": ", ".join(methods)})
        if not self.server.allow():
            return self._json(429, error_body(429))
        answer(path, params, body)

    def _route(self, path: str) -> tuple[tuple[str, ...], tuple[str, ...],
                                         Callable[[str, dict[str, str], bytes], None]] | None:
        if path == SE_PATH:
            return API_VERSIONS, ("GET", "POST"), self._scheduled_events
        if path == INSTANCE_PATH or path == COMPUTE_PATH or path.startswith(COMPUTE_PATH + "/"):
            return INSTANCE_VERSIONS, ("GET",), self._instance
        if path == VERSIONS_PATH:
            return (), ("GET",), lambda *_: self._json(200, {"apiVersions": list(INSTANCE_VERSIONS)})
        if path == IDENTITY_PATH:
            return IDENTITY_VERSIONS, ("GET",), lambda _, params, __: self._json(
                *token_answer(self.server.vm_id, params))
        return None

    def _scheduled_events(self, path: str, params: dict[str, str], body: bytes) -> None:
        emu, vm = self.server.emulator, self.server.vm
        if self.command == "GET":
            payload = json.dumps(emu.model.document(vm, params["api-version"]), separators=(",", ":")).encode()
            if not emu.etag:
                return self._send(200, payload)
            tag = '"' + hashlib.sha256(payload).hexdigest()[:20] + '"'
            wanted = [t.strip().removeprefix("W/") for t in (self.headers.get("If-None-Match") or "").split(",")]
            if tag in wanted or "*" in wanted:
                return self._send(304, b"", extra={"ETag": tag})
            return self._send(200, payload, extra={"ETag": tag})
        ids = start_requests(body)
        if ids is None:
            return self._json(400, ERR_BODY)
        try:
            emu.model.approve(vm, ids)
        except UnknownEventError as exc:
            return self._json(400, {"error": f"Bad request. {exc}"})
        self._send(200, b"")

    def _instance(self, path: str, params: dict[str, str], body: bytes) -> None:
        compute = self.server.compute()
        if path == INSTANCE_PATH:
            return self._json(200, {"compute": compute, "network": {"interface": []}})
        node: Any = compute
        for part in [p for p in path[len(COMPUTE_PATH):].split("/") if p]:
            if not isinstance(node, dict) or part not in node:
                return self._json(404, error_body(404))
            node = node[part]
        if isinstance(node, dict):
            return self._json(200, node)
        if params.get("format") != "text":
            return self._json(400, ERR_LEAF)
        self._send(200, node.encode(), "text/plain; charset=utf-8")

    # --- admin -------------------------------------------------------------------------------

    def _admin(self, url: SplitResult, body: bytes) -> None:
        if not _is_loopback(self.client_address[0]):
            return self._json(403, {"error": "the admin API answers loopback clients only"})
        try:
            data = json.loads(body) if body.strip() else {}
            if not isinstance(data, dict):
                raise ValueError("the request body must be a JSON object")
            self._json(*admin(self.server.emulator, self.server.vm, self.command, url.path[len("/admin/"):], data))
        except KeyError as exc:
            self._json(404, {"error": str(exc.args[0])})
        except ValueError as exc:
            self._json(400, {"error": str(exc)})


class VmServer(http.server.ThreadingHTTPServer):
    """The IMDS endpoint of one emulated VM (its own port, its own rate limit)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, host: str, port: int, vm: str, index: int, emulator: Host) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.vm, self.index, self.emulator = vm, index, emulator
        self.vm_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"maintd-emulator:{vm}"))
        rate = emulator.rate_limit
        self.bucket = TokenBucket(rate, emulator.clock.monotonic()) if rate else None
        self._conns: set[socket.socket] = set()
        self._resets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def allow(self) -> bool:
        """Take a token from this VM's bucket (always True without a rate limit)."""
        return self.bucket is None or self.bucket.take(self.emulator.clock.monotonic())

    def compute(self) -> Compute:
        """`compute` metadata as this VM's IMDS sends it."""
        group = "maintd-emulator"
        scale_set, computer_name = uniform_names(self.vm)
        return {"name": self.vm, "location": "westeurope", "vmId": self.vm_id, "vmSize": "Standard_D2s_v5",
                "osType": "Linux", "zone": str(self.index % self.emulator.zones + 1) if self.emulator.zones else "",
                "vmScaleSetName": scale_set, "platformFaultDomain": "0",
                "osProfile": {"adminUsername": "azureuser", "computerName": computer_name,
                              "disablePasswordAuthentication": "true"},
                "platformUpdateDomain": str(self.index % 5), "resourceGroupName": group,
                "subscriptionId": "00000000-0000-0000-0000-000000000000",
                "resourceId": f"/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/{group}"
                              f"/providers/Microsoft.Compute/virtualMachines/{self.vm}"}

    # --- serving -----------------------------------------------------------------------------

    def serve_in_thread(self) -> None:
        """Accept connections on a daemon thread until `close()` (which wakes it at once)."""
        self._thread = threading.Thread(target=self._serve, name=f"emulator-{self.vm}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._closing.is_set():
                if any(key.fileobj is self for key, _ in selector.select()) and not self._closing.is_set():
                    self.handle_request()

    def close(self) -> None:
        """Stop accepting, close the listening socket and every open connection."""
        self._closing.set()
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(5)
        self.server_close()
        self._wake_r.close()
        self._wake_w.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # --- connections -------------------------------------------------------------------------

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def reset_on_close(self, request: socket.socket) -> None:
        """Close this connection with a TCP reset instead of a FIN."""
        with self._lock:
            self._resets.add(request)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._conns.discard(request)
            reset = request in self._resets
            self._resets.discard(request)
        if reset:
            request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_request(request)
        else:
            super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away is normal here; anything else is a bug worth a traceback."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

