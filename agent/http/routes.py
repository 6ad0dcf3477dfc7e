"""maintd's HTTP server: the LB probe, /healthz, /metrics and the /v1 JSON API.

The event loop (`agent.http.http_loop`) holds the connections; this module routes a request and
answers it from `agent.http.auth.TABLE`: each route has a `Kind`, and the table's verdict for the caller (where it
comes from, which token it carries) says whether it is answered in full, with the peer view, or refused (401/403)
before its handler runs. The probe, /app-health (the Application Health extension's, for automatic instance
repairs), /healthz and /metrics answer everyone. Errors are JSON: {"error": ..., "status": ...}.
"""

from __future__ import annotations

import grp
import os
import re
import resource
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from agent.errors import HttpError
from agent.http.auth import (
    Access,
    Caller,
    Kind,
    Source,
    Token,
    Verdict,
    identify,
    peer_event_view,
    peer_health_view,
    refusal,
    verdict,
)
from agent.http.http_loop import EventLoopServer
from agent.http.http_wire import Request, error_body, json_body, response
from agent.http.listeners import listen_tcp, listen_unix
from agent.net.addresses import parse_listen
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics
from agent.trust import jsonsafe

__all__ = ["ApiError", "ApiServer", "Backend"]

ApiError = HttpError
"""An error answer: HTTP status and message (the backend raises it too)."""

_FD_RESERVE = 64
"""File descriptors kept for everything but connections (state files, hooks, IMDS, peers)."""


class Backend(Protocol):
    """What the server reads and asks of the daemon; `by` says who asked, for the audit journal. Each answer is a
    JSON object the server sends as it is (its shape is the daemon's: `agent.loop.api`)."""

    def probe(self) -> tuple[bool, str]: ...
    def app_health(self) -> tuple[bool, str]: ...
    def alive(self) -> tuple[bool, str]: ...
    def metrics_text(self) -> bytes: ...
    def status(self) -> Mapping[str, object]: ...
    def fleet(self) -> Mapping[str, object]: ...
    def fleet_history(self, since: str | None) -> Mapping[str, object]: ...
    def events(self) -> Sequence[Mapping[str, object]]: ...
    def event(self, event_id: str) -> Mapping[str, object] | None: ...
    def health(self) -> Mapping[str, object]: ...
    def drain(self, reason: str, by: str) -> Mapping[str, object]: ...
    def undrain(self, by: str) -> Mapping[str, object]: ...
    def approve(self, event_id: str, by: str) -> Mapping[str, object]: ...
    def peer_ready(self, event_id: str, body: Any) -> Mapping[str, object]: ...
    def budget_wake(self, body: Any) -> Mapping[str, object]: ...
    def report_health(self, body: Any) -> Mapping[str, object]: ...
    def peer_authorized(self, authorization: str | None) -> bool: ...


@dataclass(frozen=True)
class Route:
    """One endpoint: a bounded name for metrics, its methods, who may call it (its row of `auth.TABLE`), and its
    handler."""

    name: str
    methods: tuple[str, ...]
    kind: Kind
    handler: Callable[[Call], tuple[int, Any]]
    cheap: bool = False
    content_type: str = "application/json"
    """Of a handler's bytes; anything else it returns is sent as JSON."""


@dataclass
class Call:
    """A request being answered: the request, its caller, the table's verdict, and the path parameter."""

    request: Request
    caller: Caller
    verdict: Verdict
    arg: str = ""

    @property
    def full(self) -> bool:
        """Answered in full (an operator), not with the peer view."""
        return self.verdict == Verdict.FULL


class Router:
    """The route table, built once; `answer()` turns a request into bytes and never raises."""

    def __init__(self, backend: Backend, metrics: Metrics, access: Access, probe_path: str, max_body: int) -> None:
        self.backend = backend
        self.metrics = metrics
        self.access = access
        self.max_body = max_body
        self.log = logs.get("server")
        self._errors = logs.Throttle()
        b = backend
        get, post = ("GET",), ("POST",)
        open_, read, shared, change, hint = Kind.OPEN, Kind.READ, Kind.SHARED, Kind.CHANGE, Kind.HINT
        self.exact: dict[str, Route] = {
            probe_path: Route("probe", get, open_, self._probe, cheap=True, content_type="text/plain; charset=utf-8"),
            "/app-health": Route("app_health", get, open_, self._app_health, cheap=True),
            "/healthz": Route("healthz", get, open_, self._healthz, cheap=True),
            "/metrics": Route("metrics", get, open_, lambda c: (200, b.metrics_text()),
                              content_type="text/plain; version=0.0.4; charset=utf-8"),
            "/v1/status": Route("status", get, read, lambda c: (200, b.status())),
            "/v1/events": Route("events", get, read, lambda c: (200, b.events())),
            "/v1/fleet": Route("fleet", get, read, lambda c: (200, b.fleet())),
            "/v1/fleet/history": Route("fleet_history", get, read, lambda c: (
                200, b.fleet_history(_query(c.request.target, "since")))),
            "/v1/health": Route("health", get, shared, self._health),
            "/v1/drain": Route("drain", post, change, lambda c: (200, b.drain(_reason(self._json(c)), c.caller.by))),
            "/v1/undrain": Route("undrain", post, change, lambda c: (200, b.undrain(c.caller.by))),
            "/v1/budget/wake": Route("budget_wake", post, hint, self._budget_wake),
            "/v1/health/reports": Route("health_reports", post, change,
                                        lambda c: (200, b.report_health(self._json(c)))),
        }
        self.patterns: list[tuple[re.Pattern[str], Route]] = [
            (re.compile(r"^/v1/events/([^/]+)/approve$"),
             Route("events_approve", post, change, lambda c: (200, b.approve(c.arg, c.caller.by)))),
            (re.compile(r"^/v1/events/([^/]+)/peer-ready$"), Route("events_peer_ready", post, hint, self._peer_ready)),
            (re.compile(r"^/v1/events/([^/]+)$"), Route("event", get, shared, self._event)),
        ]

    def endpoints(self) -> dict[Kind, list[str]]:
        """Each kind's endpoints as `METHOD /path` (the README's access table names them)."""
        shown = [(path, r) for path, r in self.exact.items()] + [
            (p.pattern.strip("^$").replace("([^/]+)", "{id}"), r) for p, r in self.patterns]
        out: dict[Kind, list[str]] = {}
        for path, r in shown:
            out.setdefault(r.kind, []).extend(f"{m} {path}" for m in r.methods)
        return out

    def route(self, path: str) -> tuple[Route | None, str]:
        """The route of `path` and its parameter (None when there is no such endpoint)."""
        found = self.exact.get(path)
        if found is not None:
            return found, ""
        for pattern, candidate in self.patterns:
            match = pattern.match(path)
            if match:
                return candidate, unquote(match.group(1))
        return None, ""

    def cheap(self, request: Request) -> bool:
        found, _ = self.route(request.path)
        return found is not None and found.cheap

    def answer(self, request: Request) -> tuple[bytes, bool]:
        head_only = request.method == "HEAD"
        method = "GET" if head_only else request.method
        path = request.path
        found, arg = self.route(path)
        name = found.name if found else "unknown"
        try:
            if found is None:
                raise HttpError(404, f"no such endpoint: {path}")
            if method not in found.methods:
                raise HttpError(405, f"{method} is not allowed here; use {', '.join(found.methods)}",
                                {"Allow": ", ".join(found.methods)})
            status, body = found.handler(self._admit(found, request, arg))
        except HttpError as exc:
            return self._error(name, exc, head_only, request.keep_alive), exc.close or not request.keep_alive
        except Exception as exc:  # a bug must cost one request, not the server
            self._errors.log(self.log.error, f"{name} {type(exc).__name__}", "http.internal_error", path=path,
                             error=repr(exc), exc_info=True)
            error = HttpError(500, "internal error; see maintd's log (http.internal_error)")
            return self._error(name, error, head_only, request.keep_alive), not request.keep_alive
        self.metrics.http_requests.labels(name, str(status)).inc()
        close = not request.keep_alive
        if isinstance(body, bytes):
            return response(status, body, found.content_type, head_only=head_only, close=close), close
        return response(status, json_body(body), "application/json", head_only=head_only, close=close), close

    def refuse(self, error: HttpError) -> bytes:
        return self._error("invalid", error, False, False)

    def _error(self, route: str, error: HttpError, head_only: bool, keep_alive: bool) -> bytes:
        self.metrics.http_requests.labels(route, str(error.status)).inc()
        return response(error.status, error_body(error.status, error.message), "application/json", head_only=head_only,
                        close=error.close or not keep_alive, headers=error.headers)

    # --- handlers ------------------------------------------------------------------------

    def _probe(self, _: Call) -> tuple[int, Any]:
        ok, reason = self.backend.probe()
        return (200 if ok else 503), (reason + "\n").encode()

    def _app_health(self, _: Call) -> tuple[int, Any]:
        """The Application Health extension's rich health states (200 either way: the body says which)."""
        healthy, reason = self.backend.app_health()
        return 200, {"ApplicationHealthState": "Healthy" if healthy else "Unhealthy", "reason": reason}

    def _healthz(self, _: Call) -> tuple[int, Any]:
        ok, detail = self.backend.alive()
        return (200 if ok else 503), {"status": "ok" if ok else "stuck", "detail": detail}

    def _admit(self, route: Route, request: Request, arg: str) -> Call:
        """The request's place in `auth.TABLE`; a 401 or 403 before the handler when the table refuses it."""
        if route.kind == Kind.OPEN:  # the probe's path: nothing to look up
            return Call(request, Caller(*_ANYONE, request.client), Verdict.FULL, arg)
        caller = identify(request, self.access, self.backend.peer_authorized)
        answer = verdict(route.kind, caller)
        if answer in (Verdict.UNAUTHORIZED, Verdict.FORBIDDEN):
            message = refusal(route.kind, caller, answer, request.uid, self.access.unix_socket)
            if answer == Verdict.FORBIDDEN:
                raise HttpError(403, message)
            raise HttpError(401, message, {"WWW-Authenticate": "Bearer"})
        return Call(request, caller, answer, arg)

    def _event(self, call: Call) -> tuple[int, Any]:
        view = self.backend.event(call.arg)
        if view is None:
            raise HttpError(404, f"no event {call.arg} is known here")
        return 200, view if call.full else peer_event_view(view)

    def _health(self, call: Call) -> tuple[int, Any]:
        health = self.backend.health()
        return 200, health if call.full else peer_health_view(health)

    def _peer_ready(self, call: Call) -> tuple[int, Any]:
        """A peer's hint that it became ready: the peer token suffices, since the leader only re-asks it."""
        return 202, self.backend.peer_ready(call.arg, self._json(call))

    def _budget_wake(self, call: Call) -> tuple[int, Any]:
        """A member's hint that its release handed this VM a place: the peer token suffices, since it only makes
        this VM read the store (rate-limited) and act on what it reads there."""
        return 202, self.backend.budget_wake(self._json(call))

    def _json(self, call: Call) -> Any:
        raw = call.request.body
        if not raw.strip():
            return None
        try:
            return jsonsafe.loads(raw, max_bytes=self.max_body)
        except ValueError as exc:
            raise HttpError(400, f"body is not valid JSON ({exc})") from None


_ANYONE = (Source.ELSEWHERE, Token.NONE, True)
"""The caller of an open endpoint, never looked up."""


def _query(target: str, name: str) -> str | None:
    """A query parameter of the request's target (its last value; None when absent)."""
    values = parse_qs(urlsplit(target).query).get(name)
    return values[-1] if values else None


def _reason(body: Any) -> str:
    if body is None:
        return "manual drain"
    if not isinstance(body, dict) or not isinstance(body.get("reason", ""), str):
        raise HttpError(400, 'body must be {"reason": "text"}')
    return body.get("reason") or "manual drain"


def _fd_budget(wanted: int) -> int:
    """Connections this process can hold: raise the soft RLIMIT_NOFILE towards the hard one if needed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (ValueError, OSError):
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, min(wanted, soft - _FD_RESERVE)) if soft != resource.RLIM_INFINITY else wanted


class ApiServer:
    """The HTTP server on `listen` (or a socket-activated `sock`) and optionally a unix socket."""

    def __init__(self, listen: str | None, backend: Backend, metrics: Metrics, *, probe_path: str = "/probe",
                 token_reader: Callable[[], str | None] = lambda: None, max_body_bytes: int = 64 * 1024,
                 read_timeout: float = 5.0, sock: socket.socket | None = None, per_client: int = 32,
                 max_connections: int = 4096, require_token_on_loopback: bool = True,
                 unix_socket: str | None = None, unix_socket_group: str | None = None) -> None:
        self.log = logs.get("server")
        self.metrics = metrics
        if sock is not None:
            if listen is not None:
                self.log.warning("server.listen_overridden", listen=listen, socket=_sockname(sock),
                                 hint="systemd passed maintd.socket; server.listen is ignored "
                                      "(change the port with systemctl edit maintd.socket)")
            self.socket = sock
        else:
            assert listen is not None
            self.socket = listen_tcp(*parse_listen(listen))
        listeners = [self.socket]
        self.unix_socket = unix_socket
        if unix_socket:
            gid = grp.getgrnam(unix_socket_group).gr_gid if unix_socket_group else None
            listeners.append(listen_unix(unix_socket, gid))
        access = Access(token_reader, require_token_on_loopback, unix_socket, unix_socket_group)
        self.router = Router(backend, metrics, access, probe_path, max_body_bytes)
        self.loop = EventLoopServer(listeners, self.router, request_timeout=read_timeout, max_body=max_body_bytes,
                                    per_client=per_client, max_connections=_fd_budget(max_connections),
                                    on_drop=lambda reason: metrics.http_dropped.labels(reason).inc())

    @property
    def url(self) -> str:
        """Base URL of the server as bound (for tests and the CLI)."""
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_in_background(self) -> None:
        """Serve on the `http` thread."""
        self.loop.start()

    def close(self) -> None:
        """Stop serving (within a second) and close every socket."""
        self.loop.close()
        if self.unix_socket:
            try:
                os.unlink(self.unix_socket)
            except OSError:
                pass


def _sockname(sock: socket.socket) -> str:
    name = sock.getsockname()
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name)
