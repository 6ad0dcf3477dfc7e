"""maintd's one threaded HTTP server: the LB probe, /healthz, /metrics and the /v1 JSON API.

Never blocks the poll loop (own threads). Bounded: request body (`server.max_body_bytes`, 413
beyond), headers (the stdlib's 64 KiB line and 100-header limits, 431 beyond), read timeout (a slow
client is disconnected after `server.read_timeout`), and at most `MAX_CONNECTIONS` connections at
once (more are closed at once). Mutating endpoints answer only loopback clients or a request with
the bearer token from `server.token_file`. Errors are JSON: {"error": ..., "status": ...}.
"""

from __future__ import annotations

import hmac
import http.server
import ipaddress
import json
import re
import socket
import socketserver
import threading
from typing import Any, Callable, Protocol
from urllib.parse import unquote, urlsplit

from agent import logs
from agent.metrics import Metrics

MAX_CONNECTIONS = 128
_EVENT_ROUTE = re.compile(r"^/v1/events/([^/]+)$")
_APPROVE_ROUTE = re.compile(r"^/v1/events/([^/]+)/approve$")
_READY_ROUTE = re.compile(r"^/v1/events/([^/]+)/peer-ready$")


class ApiError(Exception):
    """An error answer: HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Backend(Protocol):
    """What the server reads and asks of the daemon."""

    def probe(self) -> tuple[bool, str]: ...
    def alive(self) -> tuple[bool, str]: ...
    def metrics_text(self) -> bytes: ...
    def status(self) -> dict[str, Any]: ...
    def events(self) -> list[dict[str, Any]]: ...
    def event(self, event_id: str) -> dict[str, Any] | None: ...
    def health(self) -> dict[str, Any]: ...
    def drain(self, reason: str) -> dict[str, Any]: ...
    def undrain(self) -> dict[str, Any]: ...
    def approve(self, event_id: str) -> dict[str, Any]: ...
    def peer_ready(self, event_id: str, body: Any) -> dict[str, Any]: ...
    def report_health(self, body: Any) -> dict[str, Any]: ...
    def peer_authorized(self, authorization: str | None) -> bool: ...


_LOCAL = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


def is_loopback(host: str) -> bool:
    """Whether a client is this host itself: exactly 127.0.0.1 or ::1 (also IPv4-mapped).

    Other 127.0.0.0/8 sources are not trusted: they are how container port forwarders and
    network namespaces reach the host, i.e. someone else.
    """
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return addr in _LOCAL


def token_ok(authorization: str | None, token: str | None) -> bool:
    """Whether `Authorization: Bearer <token>` carries the configured token (constant-time compare)."""
    if not token or not authorization:
        return False
    scheme, _, value = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


def parse_listen(listen: str) -> tuple[str, int]:
    """('host', port) from 'host:port' or '[v6]:port'."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "ApiServer"
    protocol_version = "HTTP/1.1"
    server_version = "maintd"
    sys_version = ""

    def setup(self) -> None:
        self.timeout = self.server.read_timeout
        super().setup()
        if self.connection.family in (socket.AF_INET, socket.AF_INET6):
            # headers and body leave in separate writes: without this, delayed ACKs add 40 ms per answer
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Quiet: requests are counted in metrics, errors logged by the server."""

    def _send(self, status: int, body: bytes, content_type: str, route: str, extra: dict[str, str] | None = None) -> None:
        self.server.metrics.http_requests.labels(route, str(status)).inc()  # counted before the client can look
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, route: str, extra: dict[str, str] | None = None) -> None:
        self._send(status, (json.dumps(obj, default=str, indent=None) + "\n").encode(), "application/json", route, extra)

    def _error(self, status: int, message: str, route: str, extra: dict[str, str] | None = None) -> None:
        unread_body = not self._body_read and (self.headers.get("Content-Length") or "0").strip() not in ("", "0")
        if unread_body and status not in (411, 413) and self._discard_body():
            unread_body = False
        if unread_body or status in (400, 408, 411, 413, 500):
            self.close_connection = True  # an unread body would be taken for the next request
            extra = {**(extra or {}), "Connection": "close"}  # so the client does not reuse the connection
        self._json(status, {"error": message, "status": status}, route, extra)

    def _discard_body(self) -> bool:
        """Read and drop a refused request's body (closing on unread data would reset the connection
        before the client reads the answer); False when it is too large or malformed to read."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return False
        if not 0 <= length <= self.server.max_body_bytes:
            return False
        try:
            self.rfile.read(length)
        except OSError:
            return False
        self._body_read = True
        return True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own errors (bad request line, headers too large) as JSON too."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # an unparsable request line still gets a status line and headers
        try:
            self._json(code, {"error": message or http.HTTPStatus(code).phrase, "status": code}, "invalid",
                       {"Connection": "close"})
        except OSError:
            pass

    def _body(self, route: str) -> Any:
        self._body_read = True
        length_text = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding"):
            raise ApiError(411, "send the body with a Content-Length, not chunked")
        if not length_text:
            return None
        try:
            length = int(length_text)
        except ValueError:
            raise ApiError(400, "Content-Length is not a number") from None
        if length < 0:
            raise ApiError(400, "Content-Length is negative")
        if length > self.server.max_body_bytes:
            self._body_read = False
            raise ApiError(413, f"body of {length} bytes exceeds the limit of {self.server.max_body_bytes}")
        raw = self.rfile.read(length)
        if len(raw) < length:
            raise ApiError(400, "body shorter than Content-Length")
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(400, "body is not valid JSON") from None

    def _authorize_mutation(self) -> None:
        if is_loopback(self.client_address[0]):
            return
        if token_ok(self.headers.get("Authorization"), self.server.token_reader()):
            return
        if self.headers.get("Authorization"):
            raise ApiError(403, "the bearer token is not the one in server.token_file")
        raise ApiError(401, "mutating endpoints answer only loopback clients or a bearer token (server.token_file)")

    def _authorize_read(self) -> None:
        if is_loopback(self.client_address[0]) or self.server.backend.peer_authorized(self.headers.get("Authorization")):
            return
        raise ApiError(401, "this endpoint needs the bearer token in coordination.token_file")

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        self._body_read = False
        path = urlsplit(self.path).path
        route = "unknown"
        try:
            route, handler, allowed = self._route(path)
            if method == "HEAD":
                method = "GET"
            if method not in allowed:
                raise ApiError(405, f"{method} is not allowed here; use {', '.join(allowed)}")
            handler(method)
        except ApiError as exc:
            extra = {"Allow": ", ".join(self._route(path)[2])} if exc.status == 405 else None
            if exc.status == 401:
                extra = {"WWW-Authenticate": "Bearer"}
            self._error(exc.status, exc.message, route, extra)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception as exc:  # a bug must cost one request, not the server
            self.server.log.error("http.internal_error", path=path, error=repr(exc), exc_info=True)
            self._error(500, "internal error; see maintd's log (http.internal_error)", route)

    def _route(self, path: str) -> tuple[str, Callable[[str], None], tuple[str, ...]]:
        b = self.server.backend
        if path == self.server.probe_path:
            return "probe", self._probe, ("GET",)
        simple: dict[str, tuple[Callable[[str], None], tuple[str, ...]]] = {
            "/healthz": (self._healthz, ("GET",)),
            "/metrics": (self._metrics, ("GET",)),
            "/v1/status": (lambda m: self._read(b.status), ("GET",)),
            "/v1/events": (lambda m: self._read(b.events), ("GET",)),
            "/v1/health": (lambda m: self._read(b.health), ("GET",)),
            "/v1/drain": (lambda m: self._mutate(lambda body: b.drain(_reason(body))), ("POST",)),
            "/v1/undrain": (lambda m: self._mutate(lambda body: b.undrain()), ("POST",)),
            "/v1/health/reports": (lambda m: self._mutate(b.report_health), ("POST",)),
        }
        if path in simple:
            handler, allowed = simple[path]
            return path.removeprefix("/v1/").replace("/", "_") if path.startswith("/v1/") else path.strip("/"), \
                handler, allowed
        match = _APPROVE_ROUTE.match(path)
        if match:
            event_id = unquote(match.group(1))
            return "events_approve", lambda m: self._mutate(lambda body: b.approve(event_id)), ("POST",)
        match = _READY_ROUTE.match(path)
        if match:
            event_id = unquote(match.group(1))
            return "events_peer_ready", lambda m: self._peer_ready(event_id), ("POST",)
        match = _EVENT_ROUTE.match(path)
        if match:
            event_id = unquote(match.group(1))
            return "event", lambda m: self._event(event_id), ("GET",)
        raise ApiError(404, f"no such endpoint: {path}")

    def _probe(self, _: str) -> None:
        ok, reason = self.server.backend.probe()
        self._send(200 if ok else 503, (reason + "\n").encode(), "text/plain; charset=utf-8", "probe")

    def _healthz(self, _: str) -> None:
        ok, detail = self.server.backend.alive()
        self._json(200 if ok else 503, {"status": "ok" if ok else "stuck", "detail": detail}, "healthz")

    def _metrics(self, _: str) -> None:
        self._send(200, self.server.backend.metrics_text(), "text/plain; version=0.0.4; charset=utf-8", "metrics")

    def _read(self, fn: Callable[[], Any]) -> None:
        self._authorize_read()
        self._json(200, fn(), "v1")

    def _event(self, event_id: str) -> None:
        self._authorize_read()
        view = self.server.backend.event(event_id)
        if view is None:
            raise ApiError(404, f"no event {event_id} is known here")
        self._json(200, view, "event")

    def _peer_ready(self, event_id: str) -> None:
        """A peer's hint that it became ready: peer auth suffices, since the leader only re-asks it."""
        self._authorize_read()
        self._json(202, self.server.backend.peer_ready(event_id, self._body("v1")), "v1")

    def _mutate(self, fn: Callable[[Any], dict[str, Any]]) -> None:
        self._authorize_mutation()
        body = self._body("v1")
        self._json(200, fn(body), "v1")


def _reason(body: Any) -> str:
    if body is None:
        return "manual drain"
    if not isinstance(body, dict) or not isinstance(body.get("reason", ""), str):
        raise ApiError(400, 'body must be {"reason": "text"}')
    return body.get("reason") or "manual drain"


class ApiServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """The threaded server; `serve_in_background()` starts it, `close()` stops it."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, listen: str | None, backend: Backend, metrics: Metrics, *, probe_path: str = "/probe",
                 token_reader: Callable[[], str | None] = lambda: None, max_body_bytes: int = 64 * 1024,
                 read_timeout: float = 5.0, sock: socket.socket | None = None) -> None:
        self.backend = backend
        self.metrics = metrics
        self.probe_path = probe_path
        self.token_reader = token_reader
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.log = logs.get("server")
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread: threading.Thread | None = None
        if sock is not None:
            self.address_family = sock.family
            super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
            self.socket.close()
            self.socket = sock
        else:
            assert listen is not None
            host, port = parse_listen(listen)
            self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        """Base URL of the server as bound (for tests and the CLI)."""
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.log.warning("http.connection_error", client=client_address[0] if client_address else None)

    def serve_in_background(self) -> None:
        """Serve on a daemon thread."""
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self.shutdown()
        self.server_close()
