"""A scripted IMDS on 127.0.0.1 for client and loop tests.

Real sockets, so keep-alive, resets, trickles and oversize answers are what the client really meets.
Routes are registered per method and path prefix, `responses`-style: several routes for the same
request are used in order and the last one repeats. A route answers with a `(status, headers,
body)` tuple, a `Raw` byte string (optionally trickled, then kept, closed or reset), or an exception
instance (the connection is closed without an answer).
"""

from __future__ import annotations

import json as jsonlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

JSON = "application/json; charset=utf-8"


@dataclass(frozen=True)
class Call:
    """One request as the server read it; `connection` numbers the TCP connection it came on (from 1)."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    """Header names lower-cased."""
    body: bytes
    connection: int


@dataclass(frozen=True)
class Raw:
    """Bytes sent as they are: the first `fast` at once, then one every `trickle` seconds; `then`: keep,
    close or reset the connection."""

    data: bytes
    trickle: float = 0.0
    then: str = "close"
    fast: int = 0


Responder = Callable[[Call], Any]


@dataclass
class _Route:
    method: str
    path: str
    responder: Responder


def answer(status: int = 200, json: Any = None, body: bytes | str | None = None,
           headers: dict[str, str] | None = None, content_type: str = JSON) -> Responder:
    """A responder that always gives the same answer (JSON, or `body`)."""
    payload = body if body is not None else (b"" if json is None else jsonlib.dumps(json))
    if isinstance(payload, BaseException):
        return lambda call: payload
    fixed = (status, {"Content-Type": content_type, **(headers or {})},
             payload.encode() if isinstance(payload, str) else payload)
    return lambda call: fixed


class FakeImds:
    """The server; `url` is its endpoint, `calls` what it received, `connections` how many it accepted."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.calls: list[Call] = []
        self.connections = 0
        self._routes: list[_Route] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    # --- scripting ----------------------------------------------------------------------------

    def add_callback(self, method: str, path: str, callback: Responder) -> None:
        with self._lock:
            self._routes.append(_Route(method, path, callback))

    def get(self, path: str, **kw: Any) -> None:
        self.add_callback("GET", path, answer(**kw))

    def post(self, path: str, **kw: Any) -> None:
        self.add_callback("POST", path, answer(**kw))

    def replace(self, method: str, path: str, **kw: Any) -> None:
        """The first route for `method` and `path` answers this way from now on."""
        with self._lock:
            route = next(r for r in self._routes if r.method == method and r.path == path)
            route.responder = answer(**kw)

    def upsert(self, method: str, path: str, **kw: Any) -> None:
        """Replace the first route for `method` and `path`, or add one."""
        with self._lock:
            route = next((r for r in self._routes if r.method == method and r.path == path), None)
            if route is not None:
                route.responder = answer(**kw)
                return
        self.add_callback(method, path, answer(**kw))

    def clear(self) -> None:
        """Forget every route (the calls stay recorded)."""
        with self._lock:
            self._routes.clear()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            for conn in list(self._open):
                conn.close()

    # --- serving ------------------------------------------------------------------------------

    def _respond(self, call: Call) -> Any:
        with self._lock:
            self.calls.append(call)
            matching = [r for r in self._routes if r.method == call.method and call.path.startswith(r.path)]
            if not matching:
                return 404, {"Content-Type": JSON}, b'{"error": "no route in the test"}'
            if len(matching) > 1:
                self._routes.remove(matching[0])
        return matching[0].responder(call)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._open.add(conn)
                number = self.connections
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        reader = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                call = _read_request(reader, number)
                if call is None:
                    return
                if not self._send(conn, self._respond(call)):
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def _send(self, conn: socket.socket, result: Any) -> bool:
        """Write one answer; False when the connection is to be closed."""
        if isinstance(result, BaseException):
            return False
        if isinstance(result, Raw):
            fast = len(result.data) if not result.trickle else result.fast
            conn.sendall(result.data[:fast])
            for i in range(fast, len(result.data)):
                if self._stop.wait(result.trickle):
                    return False
                conn.sendall(result.data[i:i + 1])
            if result.then == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return result.then == "keep"
        status, headers, body = result
        if isinstance(body, str):
            body = body.encode()
        head = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
        if status != 304:
            head.append(f"Content-Length: {len(body)}")
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        return True


def _read_request(reader: Any, number: int) -> Call | None:
    line = reader.readline(65536)
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: dict[str, str] = {}
    while (line := reader.readline(65536)) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = reader.read(int(headers.get("content-length", "0")))
    url = urlsplit(target)
    return Call(method, url.path, dict(parse_qsl(url.query)), headers, body, number)


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Poll `predicate` until it is truthy (real time; for the server's threads to catch up)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if result := predicate():
            return result
        time.sleep(0.01)
    raise AssertionError("condition not met in time")
