"""What the HTTP event loop keeps per connection, apart from the loop itself: a connection's state
and the incremental parsing of the request arriving on it, the heap of per-request deadlines, and
the rate-limited record of protective closes. Nothing here blocks or owns a thread.
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
import socket
import struct
import time
from typing import Any, Callable, Iterator

from agent import logs
from agent.http.http_wire import Request, head_end, parse_head

READ, BUSY, WRITE, LINGER = range(4)
"""A connection waits for a request, is with a worker, is sending an answer, or is closing."""
DROP_LOG_EVERY = 60.0
"""Seconds between two `http.connection_dropped` log lines of one reason (the metric counts each)."""
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


def try_send(sock: socket.socket, data: bytes | memoryview) -> int:
    """Bytes sent without blocking: 0 when the socket is full, -1 when it is gone."""
    try:
        return sock.send(data)
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError:
        return -1


class Conn:
    """One client connection: its socket, who it is, what has arrived and what is left to send."""

    __slots__ = ("sock", "client", "uid", "gid", "local", "buf", "state", "deadline", "out", "request", "accepted")

    def __init__(self, sock: socket.socket, client: str, creds: tuple[int, int] | None, local: bool,
                 now: float) -> None:
        self.sock, self.client = sock, client
        self.uid, self.gid = creds if creds else (None, None)
        self.local = local
        self.buf = bytearray()
        self.state = READ
        self.deadline = now
        self.out = memoryview(b"")
        self.request: Request | None = None
        self.accepted = now

    @classmethod
    def accepted_from(cls, sock: socket.socket, addr: Any, now: float) -> Conn:
        """A just-accepted socket, non-blocking: a unix socket's caller by uid/gid (`SO_PEERCRED`), local;
        a TCP one by address, local only from 127.0.0.1 or ::1."""
        sock.setblocking(False)
        if sock.family == socket.AF_UNIX:
            _, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return cls(sock, "", (uid, gid), True, now)
        # headers and body leave in one write, but a client's delayed ACK must never hold an answer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock, addr[0], None, is_loopback(addr[0]), now)

    @property
    def open(self) -> bool:
        return self.sock.fileno() >= 0

    def waiting_for_more(self) -> bool:
        """Whether part of a request has arrived (a deadline then answers 408 rather than closing quietly)."""
        return bool(self.buf) or self.request is not None

    def take(self, max_body: int) -> Request | None:
        """The request complete in the buffer (removed from it), or None while it is still arriving.

        Raises HttpError for one that cannot be served. Answers `Expect: 100-continue` once its head is in.
        """
        if self.request is None:
            end = head_end(self.buf)
            if end < 0:
                return None
            try:
                self.request = parse_head(bytes(self.buf[:end]), max_body)
            finally:
                del self.buf[:end]
            self.request.client, self.request.uid, self.request.gid = self.client, self.uid, self.gid
            if self.request.expects_continue and len(self.buf) < self.request.content_length:
                try_send(self.sock, b"HTTP/1.1 100 Continue\r\n\r\n")
        request = self.request
        if len(self.buf) < request.content_length:
            return None
        request.body = bytes(self.buf[:request.content_length])
        del self.buf[:request.content_length]
        self.request = None
        return request


class Deadlines:
    """Each connection's one current deadline, in a heap; a moved deadline leaves a stale entry behind,
    skipped when it comes up."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Conn]] = []
        self._seq = itertools.count()

    def set(self, conn: Conn, seconds: float) -> None:
        conn.deadline = time.monotonic() + seconds
        heapq.heappush(self._heap, (conn.deadline, next(self._seq), conn))

    @staticmethod
    def _live(deadline: float, conn: Conn) -> bool:
        return conn.deadline == deadline and conn.open and conn.state != BUSY

    def timeout(self) -> float | None:
        """Seconds until the next deadline, None (block) when no connection has one."""
        while self._heap:
            deadline, _, conn = self._heap[0]
            if self._live(deadline, conn):
                return max(0.0, deadline - time.monotonic())
            heapq.heappop(self._heap)
        return None

    def expired(self, now: float) -> Iterator[Conn]:
        """The connections whose deadline has passed, each once."""
        while self._heap and self._heap[0][0] <= now:
            deadline, _, conn = heapq.heappop(self._heap)
            if self._live(deadline, conn):
                yield conn


class Drops:
    """Protective closes: each is counted (`on_drop`); the first of a reason is logged, then at most
    one line per DROP_LOG_EVERY saying how many more there were."""

    def __init__(self, on_drop: Callable[[str], None]) -> None:
        self.on_drop = on_drop
        self.log = logs.get("server")
        self._last: dict[str, tuple[float, int]] = {}

    def __call__(self, reason: str, client: str, open_connections: int) -> None:
        self.on_drop(reason)
        now = time.monotonic()
        last, since = self._last.get(reason, (float("-inf"), 0))
        if now - last < DROP_LOG_EVERY:
            self._last[reason] = (last, since + 1)
            return
        self._last[reason] = (now, 0)
        self.log.warning("http.connection_dropped", reason=reason, client=client, more_since_last_line=since,
                         open_connections=open_connections)
