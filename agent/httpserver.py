"""The HTTP event loop: one thread, stdlib `selectors`, that nobody can starve and that sleeps while idle.

Each connection costs a file descriptor and a small buffer, not a thread. A request must arrive
whole (head and body) within `request_timeout` of the moment the server started waiting for it —
a deadline per request, not per read, so trickling one byte at a time buys nothing. One client
address holds at most `per_client` connections (loopback and the unix socket are exempt); when
`max_connections` are open, a new connection evicts the oldest one waiting for a request from
another address rather than being refused, so a load balancer's probe always gets in.

Cheap answers (the probe, /healthz) are made on the loop itself, so they never wait for a busy
worker; the rest runs on a small worker pool whose answers come back through a socketpair. The
loop blocks in `select` until a connection, data, the next deadline or `close()`: no periodic
wake-up while idle.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import os
import selectors
import socket
import stat
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
import errno
import ipaddress
from typing import Callable, Protocol

from agent import logs
from agent.httpwire import HttpError, Request, head_end, parse_head

DROP_LOG_EVERY = 60.0
"""Seconds between two `http.connection_dropped` log lines of one reason (the metric counts each)."""
LINGER = 1.0
"""Seconds a closing connection keeps reading (and dropping) what the client still sends, so the
kernel does not reset the connection before the client has read the answer."""
_LOCAL = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
_READ, _BUSY, _WRITE, _LINGER = range(4)


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


class App(Protocol):
    """What the loop serves: answers as bytes, each with whether to close the connection after it."""

    def cheap(self, request: Request) -> bool:
        """Whether to answer on the loop thread (it must not block)."""

    def answer(self, request: Request) -> tuple[bytes, bool]:
        """The answer to a complete request (never raises)."""

    def refuse(self, error: HttpError) -> bytes:
        """The answer to a request that could not be read (malformed, too large, too slow, server busy)."""


class _Conn:
    __slots__ = ("sock", "client", "uid", "gid", "local", "buf", "state", "deadline", "out", "request", "accepted")

    def __init__(self, sock: socket.socket, client: str, creds: tuple[int, int] | None, now: float) -> None:
        self.sock, self.client = sock, client
        self.uid, self.gid = creds if creds else (None, None)
        self.local = creds is not None or is_loopback(client)
        self.buf = bytearray()
        self.state = _READ
        self.deadline = now
        self.out = memoryview(b"")
        self.request: Request | None = None
        self.accepted = now


class EventLoopServer:
    """Serves `app` on `listeners` from one thread; `start()` and `close()`."""

    def __init__(self, listeners: list[socket.socket], app: App, *, request_timeout: float, max_body: int,
                 per_client: int, max_connections: int, workers: int = 4,
                 on_drop: Callable[[str], None] = lambda reason: None) -> None:
        self.app = app
        self.on_drop = on_drop
        self.request_timeout = request_timeout
        self.max_body = max_body
        self.per_client = per_client
        self.max_connections = max_connections
        self.max_queued = workers * 16
        self.log = logs.get("server")
        self._sel = selectors.DefaultSelector()
        self._listeners = listeners
        for sock in listeners:
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ, self._accept)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._woken)
        self._conns: dict[int, _Conn] = {}
        self._per_client: collections.Counter[str] = collections.Counter()
        self._deadlines: list[tuple[float, int, _Conn]] = []
        self._seq = itertools.count()
        self._done: collections.deque[tuple[_Conn, bytes, bool]] = collections.deque()
        self._queued = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="http-worker")
        self._drops: dict[str, tuple[float, int]] = {}
        self._stop = False
        self._paused = False
        self._thread: threading.Thread | None = None

    @property
    def connections(self) -> int:
        """Connections open now (tests, status)."""
        return len(self._conns)

    def start(self) -> None:
        """Serve on a daemon thread named `http`."""
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        """The serving thread's kernel id (to read its /proc status)."""
        return self._thread.native_id if self._thread else None

    def close(self, timeout: float = 1.0) -> None:
        """Stop serving within `timeout` seconds: the listeners and every connection are closed."""
        self._stop = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                for key, mask in self._sel.select(self._timeout()):
                    try:
                        key.data(key.fileobj, mask)
                    except Exception as exc:  # a bug costs one connection, never the server
                        self._failed(key.fileobj, exc)
                    if self._stop:
                        break
                self._expire(time.monotonic())
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            for sock in (*self._listeners, self._wake_r, self._wake_w):
                sock.close()
            self._sel.close()

    def _failed(self, sock: socket.socket, exc: Exception) -> None:
        self.log.error("http.internal_error", error=repr(exc), exc_info=True)
        conn = self._conns.get(sock.fileno())
        if conn is not None:
            try:
                self._close(conn)
            except (OSError, KeyError, ValueError):
                pass

    def _timeout(self) -> float | None:
        """Seconds until the next deadline, None (block) when no connection has one."""
        while self._deadlines:
            deadline, _, conn = self._deadlines[0]
            if conn.deadline == deadline and conn.sock.fileno() >= 0 and conn.state != _BUSY:
                return max(0.0, deadline - time.monotonic())
            heapq.heappop(self._deadlines)
        return None

    def _set_deadline(self, conn: _Conn, seconds: float) -> None:
        conn.deadline = time.monotonic() + seconds
        heapq.heappush(self._deadlines, (conn.deadline, next(self._seq), conn))

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, conn = heapq.heappop(self._deadlines)
            if conn.deadline != deadline or conn.sock.fileno() < 0 or conn.state == _BUSY:
                continue
            try:
                if conn.state == _READ and (conn.buf or conn.request is not None):
                    self._dropped("request_timeout", conn.client)
                    self._send(conn, self.app.refuse(HttpError(408, "the request did not arrive in time", close=True)),
                               True)
                else:
                    self._close(conn)  # idle keep-alive, a client that does not read its answer, or done lingering
            except Exception as exc:
                self._failed(conn.sock, exc)

    # --- connections ---------------------------------------------------------------------

    def _accept(self, listener: socket.socket, _: int) -> None:
        for _ in range(64):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: make room, or stop accepting until one closes
                self.log.warning("http.accept_failed", error=str(exc), open_connections=len(self._conns))
                if exc.errno in (errno.EMFILE, errno.ENFILE) and not self._evict():
                    self._pause(True)
                return
            sock.setblocking(False)
            creds = None
            if sock.family == socket.AF_UNIX:
                _, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                client, creds = "", (uid, gid)
            else:
                client = addr[0]
                # headers and body leave in one write, but a client's delayed ACK must never hold an answer
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, client, creds, time.monotonic())
            if not conn.local and self._per_client[client] >= self.per_client:
                self._dropped("per_client", client)
                sock.close()
                continue
            if len(self._conns) >= self.max_connections and not self._evict():
                sock.close()
                continue
            self._conns[sock.fileno()] = conn
            self._per_client[client] += 1
            self._sel.register(sock, selectors.EVENT_READ, self._readable)
            self._set_deadline(conn, self.request_timeout)

    def _evict(self) -> bool:
        """Close the oldest non-local connection that waits for a request; False when there is none."""
        waiting = [c for c in self._conns.values() if c.state == _READ and not c.local]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.accepted)
        self._dropped("evicted", oldest.client)
        self._close(oldest)
        return True

    def _dropped(self, reason: str, client: str) -> None:
        """Count a protective close; log the first of a reason, then at most once per DROP_LOG_EVERY."""
        self.on_drop(reason)
        now = time.monotonic()
        last, since = self._drops.get(reason, (float("-inf"), 0))
        if now - last < DROP_LOG_EVERY:
            self._drops[reason] = (last, since + 1)
            return
        self._drops[reason] = (now, 0)
        self.log.warning("http.connection_dropped", reason=reason, client=client, more_since_last_line=since,
                         open_connections=len(self._conns))

    def _close(self, conn: _Conn) -> None:
        if conn.sock.fileno() < 0:
            return
        self._conns.pop(conn.sock.fileno(), None)
        self._per_client[conn.client] -= 1
        if self._per_client[conn.client] <= 0:
            del self._per_client[conn.client]
        if conn.state != _BUSY:
            self._sel.unregister(conn.sock)
        conn.sock.close()
        self._pause(False)

    def _pause(self, paused: bool) -> None:
        """Stop (or resume) accepting: a listener that cannot accept would otherwise wake the loop at once, forever."""
        if paused == self._paused or self._stop:
            return
        self._paused = paused
        for sock in self._listeners:
            if paused:
                self._sel.unregister(sock)
            else:
                self._sel.register(sock, selectors.EVENT_READ, self._accept)

    def _readable(self, sock: socket.socket, _: int) -> None:
        conn = self._conns.get(sock.fileno())
        if conn is None:
            return
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
        elif conn.state == _LINGER:
            pass  # dropped: the answer is sent, the connection is closing
        else:
            conn.buf += data
            self._take(conn)

    def _take(self, conn: _Conn) -> None:
        """Parse what has arrived; dispatch a complete request."""
        try:
            if conn.request is None:
                end = head_end(conn.buf)
                if end < 0:
                    return
                conn.request = parse_head(bytes(conn.buf[:end]), self.max_body)
                conn.request.client, conn.request.uid, conn.request.gid = conn.client, conn.uid, conn.gid
                del conn.buf[:end]
                if conn.request.expects_continue and len(conn.buf) < conn.request.content_length:
                    self._try_send(conn.sock, b"HTTP/1.1 100 Continue\r\n\r\n")
            request = conn.request
            if len(conn.buf) < request.content_length:
                return
        except HttpError as exc:
            conn.request = None
            self._send(conn, self.app.refuse(exc), True)
            return
        request.body = bytes(conn.buf[:request.content_length])
        del conn.buf[:request.content_length]
        conn.request = None
        self._dispatch(conn, request)

    def _dispatch(self, conn: _Conn, request: Request) -> None:
        if self.app.cheap(request):
            self._send(conn, *self.app.answer(request))
            return
        if self._queued >= self.max_queued:
            self._send(conn, self.app.refuse(HttpError(503, "busy; try again", {"Retry-After": "1"}, close=True)), True)
            return
        conn.state = _BUSY
        self._sel.unregister(conn.sock)
        self._queued += 1
        self._pool.submit(self._work, conn, request)

    def _work(self, conn: _Conn, request: Request) -> None:
        """On a worker: answer, then hand the bytes back to the loop."""
        data, close = self.app.answer(request)
        self._done.append((conn, data, close))
        self._wake()

    def _woken(self, sock: socket.socket, _: int) -> None:
        try:
            while sock.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._done:
            conn, data, close = self._done.popleft()
            self._queued -= 1
            if conn.sock.fileno() >= 0:
                conn.state = _READ
                self._sel.register(conn.sock, selectors.EVENT_READ, self._readable)
                self._send(conn, data, close)

    def _wake(self) -> None:
        self._try_send(self._wake_w, b"x")

    @staticmethod
    def _try_send(sock: socket.socket, data: bytes) -> int:
        try:
            return sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            return -1

    # --- answers -------------------------------------------------------------------------

    def _send(self, conn: _Conn, data: bytes, close: bool) -> None:
        conn.out = memoryview(data)
        conn.state = _WRITE if not close else _LINGER
        if close:
            conn.buf.clear()
        self._flush(conn, first=True)

    def _flush(self, conn: _Conn, first: bool = False) -> None:
        sent = self._try_send(conn.sock, conn.out)
        if sent < 0:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        closing = conn.state == _LINGER
        if conn.out:
            if first:
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, self._writable)
                self._set_deadline(conn, self.request_timeout)
            return
        if not first:
            self._sel.modify(conn.sock, selectors.EVENT_READ, self._readable)
        if closing:
            self._linger(conn)
            return
        conn.state = _READ
        self._set_deadline(conn, self.request_timeout)
        if conn.buf:
            self._take(conn)  # a pipelined request already arrived

    def _writable(self, sock: socket.socket, _: int) -> None:
        conn = self._conns.get(sock.fileno())
        if conn is not None:
            self._flush(conn)

    def _linger(self, conn: _Conn) -> None:
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        self._set_deadline(conn, LINGER)


def listen_tcp(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when host has a colon)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def listen_unix(path: str, gid: int | None, backlog: int = 64) -> socket.socket:
    """A listening unix socket at `path`, mode 0660 (owner root, group `gid`), replacing a stale socket
    (never another kind of file: a path pointed at /etc/passwd is refused, not unlinked)."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    if gid is not None:
        os.chown(path, -1, gid)
    sock.listen(backlog)
    return sock

