"""What the HTTP event loop keeps per connection, apart from the loop itself: a connection's state
and the incremental parsing of the request arriving on it, the heap of per-request deadlines, and
the bytes buffered by all connections together, and the rate-limited record of protective closes.
Nothing here blocks or owns a thread.
"""

from __future__ import annotations

import collections
import heapq
import ipaddress
import itertools
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

from agent.http.http_wire import Request, head_end, parse_head
from agent.http.peer_owner import PeerOwners
from agent.telemetry import logs

READ, BUSY, WRITE, LINGER = range(4)
"""A connection waits for a request, is with a worker, is sending an answer, or is closing."""
UNSENT_LIMIT = 64 * 1024
"""Bytes of answers one TCP connection may have waiting in the kernel, unsent (`TCP_NOTSENT_LOWAT`): the
next pipelined request is answered only once the client has read nearly all of the last answer."""
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


class Buffered:
    """The bytes every connection's input buffer holds, together, against one budget."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def fits(self, more: int) -> bool:
        return self.used + more <= self.limit


class Conn:
    """One client connection: its socket, who it is, what has arrived and what is left to send."""

    __slots__ = ("sock", "client", "uid", "gid", "buffered", "buf", "state", "deadline", "out", "request", "accepted",
                 "eof", "scheduled", "local_uid")

    def __init__(self, sock: socket.socket, client: str, creds: tuple[int, int] | None, buffered: Buffered,
                 now: float, local_uid: int | None = None) -> None:
        self.sock, self.client = sock, client
        self.uid: int | None
        self.gid: int | None
        self.uid, self.gid = creds if creds else (None, None)
        self.buffered = buffered
        self.buf = bytearray()
        self.state = READ
        self.deadline = now
        self.out = memoryview(b"")
        self.request: Request | None = None
        self.accepted = now
        self.eof = False
        """The client has shut down its sending side: answer what it sent, then close."""
        self.scheduled = False
        """In the loop's line of connections to serve (each is in it at most once)."""
        self.local_uid = local_uid
        """Over loopback TCP, the uid owning the client's end (it counts the connection; it authorizes nothing)."""

    @classmethod
    def accepted_from(cls, sock: socket.socket, addr: Any, buffered: Buffered, now: float, owners: PeerOwners) -> Conn:
        """A just-accepted socket, non-blocking: a unix socket's caller by uid/gid (`SO_PEERCRED`), a TCP one by
        address, and a loopback one also by the uid owning its other end."""
        sock.setblocking(False)
        if sock.family == socket.AF_UNIX:
            _, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return cls(sock, "", (uid, gid), buffered, now)
        # headers and body leave in one write, but a client's delayed ACK must never hold an answer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, UNSENT_LIMIT)
        return cls(sock, addr[0], None, buffered, now, owners.uid(sock))

    @property
    def open(self) -> bool:
        return self.sock.fileno() >= 0

    @property
    def who(self) -> str:
        """Whom the per-client cap counts this connection against: its address; over loopback TCP, the uid owning
        the other end (one local user's connections cannot crowd out root's watchdog or the local probe); on the
        unix socket, its uid."""
        if self.local_uid is not None:
            return f"local uid {self.local_uid}"
        return self.client or f"uid {self.uid}"

    def feed(self, data: bytes) -> None:
        """Add bytes that arrived (counted in `buffered`)."""
        self.buf += data
        self.buffered.used += len(data)

    def _consume(self, size: int) -> bytes:
        taken = bytes(self.buf[:size])
        del self.buf[:size]
        self.buffered.used -= len(taken)
        if not self.buf:
            self.buf = bytearray()  # a drained buffer gives its memory back
        return taken

    def discard(self) -> None:
        """Drop what is buffered (the connection is closing)."""
        self._consume(len(self.buf))

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
            self.request = parse_head(self._consume(end), max_body)
            self.request.client, self.request.uid, self.request.gid = self.client, self.uid, self.gid
            if self.request.expects_continue and len(self.buf) < self.request.content_length:
                try_send(self.sock, b"HTTP/1.1 100 Continue\r\n\r\n")
        request = self.request
        if len(self.buf) < request.content_length:
            return None
        request.body = self._consume(request.content_length)
        self.request = None
        return request


class Table:
    """The open connections by file descriptor: counted per client, their input buffers against one budget,
    and which one to give up when room is needed."""

    def __init__(self, per_client: int, max_connections: int, max_buffered: int) -> None:
        self.per_client = per_client
        self.max_connections = max_connections
        self.buffered = Buffered(max_buffered)
        self._by_fd: dict[int, Conn] = {}
        self._count: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._by_fd)

    def get(self, fd: int) -> Conn | None:
        return self._by_fd.get(fd)

    def all(self) -> list[Conn]:
        return list(self._by_fd.values())

    def over_share(self, conn: Conn) -> bool:
        """Whether `conn`'s client already holds its `per_client` connections."""
        return self._count[conn.who] >= self.per_client

    @property
    def full(self) -> bool:
        return len(self._by_fd) >= self.max_connections

    def add(self, conn: Conn) -> None:
        self._by_fd[conn.sock.fileno()] = conn
        self._count[conn.who] += 1

    def remove(self, conn: Conn) -> None:
        """Forget `conn` (before its socket is closed) and drop what it buffered."""
        self._by_fd.pop(conn.sock.fileno(), None)
        self._count[conn.who] -= 1
        if self._count[conn.who] <= 0:
            del self._count[conn.who]
        conn.discard()

    def to_evict(self) -> Conn | None:
        """The oldest connection not with a worker of the client holding the most; None when every one is."""
        idle = [c for c in self._by_fd.values() if c.state != BUSY]
        return min(idle, key=lambda c: (-self._count[c.who], c.accepted)) if idle else None

    def to_shrink(self, more: int) -> Conn | None:
        """The connection with the largest buffer while `more` bytes do not fit in the budget; None once they do."""
        if self.buffered.fits(more) or not self._by_fd:
            return None
        return max(self._by_fd.values(), key=lambda c: len(c.buf))


class Line:
    """The connections waiting to be served, each at most once: those that were idle (a new connection's first
    request, a keep-alive client's next) first, then those with more pipelined requests, round-robin."""

    def __init__(self) -> None:
        self._first: collections.deque[Conn] = collections.deque()
        self._then: collections.deque[Conn] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._first or self._then)

    def add(self, conn: Conn, first: bool = False) -> None:
        """Put `conn` in line when it may have a request to answer (or its half-close to act on)."""
        if conn.scheduled or conn.state != READ or not conn.open or not (conn.buf or conn.eof):
            return
        conn.scheduled = True
        (self._first if first else self._then).append(conn)

    def next(self) -> Conn:
        """The connection to serve next (taken out of line)."""
        conn = (self._first or self._then).popleft()
        conn.scheduled = False
        return conn


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
        self._throttle = logs.Throttle(DROP_LOG_EVERY)

    def __call__(self, reason: str, client: str, open_connections: int) -> None:
        self.on_drop(reason)
        self._throttle.log(self.log.warning, reason, "http.connection_dropped", reason=reason, client=client,
                           open_connections=open_connections)
