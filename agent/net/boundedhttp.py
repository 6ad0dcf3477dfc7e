"""HTTP exchanges bounded in bytes and in total time: every answer from a peer, a gate or a webhook.

requests' `timeout` bounds each read, not the exchange, and `Response.content` reads the whole body
before anyone can look at its size: a peer trickling a byte a second held an ask for as long as it
liked, and an endless answer grew the leader's memory without bound (issue 24). `exchange` sends
the request with `stream=True` and no redirects, asks for an uncompressed answer, reads the body in
chunks up to the caller's byte cap, and keeps one deadline for the whole exchange (headers and
body): a watchdog thread shuts the exchange's socket down when the deadline passes, so the read
under way fails at once and `exchange` raises `ExchangeTimeout`.

The watchdog learns the socket from the connection classes of the `Adapter` (mounted by `session`):
`getresponse` registers its socket with the exchange running on that thread. The thread starts at
the first exchange and sleeps while none is under way (no wake-ups when idle).
"""

from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.poolmanager import ProxyManager

from agent.errors import AnswerTooLarge, ExchangeTimeout

CHUNK = 64 * 1024
REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class Reply:
    """One answer, read whole (or, with `truncate`, its first `max_bytes`): status, headers, body."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    truncated: bool = False

    @property
    def text(self) -> str:
        """The body as text (undecodable bytes replaced)."""
        return self.body.decode("utf-8", "replace")

    @property
    def is_redirect(self) -> bool:
        """A redirect with a target (as requests defines it); never followed here."""
        return self.status in REDIRECTS and "location" in {k.lower() for k in self.headers}


@dataclass(eq=False)
class _Watch:
    """One exchange's deadline and the socket the watchdog shuts down when it passes."""

    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None
    fired: bool = False

    def attach(self, sock: socket.socket) -> None:
        with self.lock:
            self.sock = sock
            late = self.fired
        if late:
            _shut(sock)

    def detach(self) -> None:
        """The exchange ended: its socket (maybe back in the pool, serving another) is never cut."""
        with self.lock:
            self.sock = None

    def fire(self) -> None:
        with self.lock:
            self.fired, sock = True, self.sock
        if sock is not None:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    """Make any read on `sock` fail now (the plain socket's shutdown, even under TLS)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: nothing left to cut


class _Watchdog:
    """One thread firing the watches whose deadline passed; asleep while no exchange is under way."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Watch]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, timeout: float) -> _Watch:
        watch = _Watch(time.monotonic() + timeout)
        with self._cond:
            heapq.heappush(self._heap, (watch.deadline, next(self._seq), watch))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="http-deadline", daemon=True)
                self._thread.start()
            self._cond.notify()
        return watch

    def done(self, watch: _Watch) -> None:
        watch.detach()
        with self._cond:
            self._heap = [item for item in self._heap if item[2] is not watch]
            heapq.heapify(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, watch = heapq.heappop(self._heap)
            watch.fire()


WATCHDOG = _Watchdog()
_current = threading.local()


class _Watched:
    """Registers the connection's socket with the exchange on this thread before the answer is read."""

    sock: socket.socket | None

    def getresponse(self, *args: Any, **kwargs: Any) -> Any:
        watch: _Watch | None = getattr(_current, "watch", None)
        if watch is not None and self.sock is not None:
            watch.attach(self.sock)
        return super().getresponse(*args, **kwargs)  # type: ignore[misc]


class _HTTPConnection(_Watched, HTTPConnection):
    pass


class _HTTPSConnection(_Watched, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


POOLS = {"http": _HTTPPool, "https": _HTTPSPool}


class Adapter(HTTPAdapter):
    """requests' adapter with connections the watchdog can cut (direct and through an HTTP proxy)."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = POOLS

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(proxy, **kwargs)
        if isinstance(manager, ProxyManager):  # a SOCKS manager keeps its own connections
            manager.pool_classes_by_scheme = POOLS
        return manager


def session(pool_size: int = 10, trust_env: bool = True) -> requests.Session:
    """A session whose exchanges `exchange` can bound (no adapter-level retries: callers retry)."""
    s = requests.Session()
    s.trust_env = trust_env
    adapter = Adapter(pool_connections=pool_size, pool_maxsize=pool_size, max_retries=0)
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    return s


def _read(raw: Any, max_bytes: int, watch: _Watch) -> tuple[bytes, bool]:
    """The body, up to `max_bytes`, and whether there was more."""
    body = bytearray()
    while len(body) <= max_bytes:
        try:
            chunk = raw.read(min(CHUNK, max_bytes + 1 - len(body)), decode_content=False)
        except Urllib3Error as exc:  # cut short or malformed framing: the transport failed
            raise ConnectionError(f"answer cut short ({type(exc).__name__})") from None
        if watch.fired:
            raise ExchangeTimeout()
        if not chunk:
            return bytes(body), False
        body += chunk
    return bytes(body[:max_bytes]), True


def exchange(s: requests.Session, method: str, url: str, *, timeout: float, max_bytes: int,
             truncate: bool = False, headers: Mapping[str, str] | None = None, **kwargs: Any) -> Reply:
    """One request and its whole answer within `timeout` seconds and `max_bytes` of body.

    Raises `ExchangeTimeout` past the deadline, `AnswerTooLarge` for a longer body (unless `truncate`: the Reply
    then holds its head), and requests' errors (OSErrors) for a failed connection.
    """
    watch = WATCHDOG.watch(timeout)
    _current.watch = watch
    try:
        r = s.request(method, url, stream=True, allow_redirects=False, timeout=timeout,
                      headers={"Accept-Encoding": "identity", **(headers or {})}, **kwargs)
        try:
            body, more = _read(r.raw, max_bytes, watch)
        except BaseException:
            r.close()
            raise
        watch.detach()  # before the connection goes back to the pool, where the watchdog must never cut it
        if more or watch.fired:
            r.close()
        else:
            r.raw.release_conn()  # read to the end: the connection is kept for the next exchange
        if more and not truncate:
            raise AnswerTooLarge(f"answer over {max_bytes} bytes")
        return Reply(r.status_code, r.headers, body, more)
    except OSError:
        if watch.fired:
            raise ExchangeTimeout(f"no whole answer within {timeout:g} s") from None
        raise
    finally:
        _current.watch = None
        WATCHDOG.done(watch)
