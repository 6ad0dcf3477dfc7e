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
wake-up while idle. A connection's state, parsing and deadlines are `httpconn`'s.
"""

from __future__ import annotations

import collections
import errno
import os
import selectors
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Protocol

from agent import logs
from agent.http.http_connection import BUSY, LINGER, READ, WRITE, Conn, Deadlines, Drops, try_send
from agent.http.http_wire import HttpError, Request

LINGER_SECONDS = 1.0
"""Seconds a closing connection keeps reading (and dropping) what the client still sends, so the
kernel does not reset the connection before the client has read the answer."""


class App(Protocol):
    """What the loop serves: answers as bytes, each with whether to close the connection after it."""

    def cheap(self, request: Request) -> bool:
        """Whether to answer on the loop thread (it must not block)."""

    def answer(self, request: Request) -> tuple[bytes, bool]:
        """The answer to a complete request (never raises)."""

    def refuse(self, error: HttpError) -> bytes:
        """The answer to a request that could not be read (malformed, too large, too slow, server busy)."""


class Workers:
    """The worker pool for answers that may block, and their way back to the loop: a queue, and a
    socketpair whose readable end wakes the loop's `select`."""

    def __init__(self, workers: int, answer: Callable[[Request], tuple[bytes, bool]]) -> None:
        self.answer = answer
        self.max_queued = workers * 16
        self.queued = 0
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self._done: collections.deque[tuple[Conn, bytes, bool]] = collections.deque()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="http-worker")

    def submit(self, conn: Conn, request: Request) -> None:
        self.queued += 1
        self._pool.submit(self._work, conn, request)

    def _work(self, conn: Conn, request: Request) -> None:
        data, close = self.answer(request)
        self._done.append((conn, data, close))
        self.wake()

    def wake(self) -> None:
        try_send(self.wake_w, b"x")

    def answers(self) -> Iterator[tuple[Conn, bytes, bool]]:
        """The answers workers have finished (on the loop, once `wake_r` is readable)."""
        try:
            while self.wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._done:
            self.queued -= 1
            yield self._done.popleft()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class EventLoopServer:
    """Serves `app` on `listeners` from one thread; `start()` and `close()`."""

    def __init__(self, listeners: list[socket.socket], app: App, *, request_timeout: float, max_body: int,
                 per_client: int, max_connections: int, workers: int = 4,
                 on_drop: Callable[[str], None] = lambda reason: None) -> None:
        self.app = app
        self.request_timeout = request_timeout
        self.max_body = max_body
        self.per_client = per_client
        self.max_connections = max_connections
        self.log = logs.get("server")
        self._dropped = Drops(on_drop)
        self._sel = selectors.DefaultSelector()
        self._listeners = listeners
        for sock in listeners:
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ, self._accept)
        self._workers = Workers(workers, app.answer)
        self._sel.register(self._workers.wake_r, selectors.EVENT_READ, self._woken)
        self._conns: dict[int, Conn] = {}
        self._per_client: collections.Counter[str] = collections.Counter()
        self._deadlines = Deadlines()
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
        self._workers.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._workers.shutdown()

    # --- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                for key, mask in self._sel.select(self._deadlines.timeout()):
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
            for sock in (*self._listeners, self._workers.wake_r, self._workers.wake_w):
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

    def _expire(self, now: float) -> None:
        for conn in self._deadlines.expired(now):
            try:
                if conn.state == READ and conn.waiting_for_more():
                    self._dropped("request_timeout", conn.client, len(self._conns))
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
            conn = Conn.accepted_from(sock, addr, time.monotonic())
            client = conn.client
            if not conn.local and self._per_client[client] >= self.per_client:
                self._dropped("per_client", client, len(self._conns))
                sock.close()
                continue
            if len(self._conns) >= self.max_connections and not self._evict():
                sock.close()
                continue
            self._conns[sock.fileno()] = conn
            self._per_client[client] += 1
            self._sel.register(sock, selectors.EVENT_READ, self._readable)
            self._deadlines.set(conn, self.request_timeout)

    def _evict(self) -> bool:
        """Close the oldest non-local connection that waits for a request; False when there is none."""
        waiting = [c for c in self._conns.values() if c.state == READ and not c.local]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.accepted)
        self._dropped("evicted", oldest.client, len(self._conns))
        self._close(oldest)
        return True

    def _close(self, conn: Conn) -> None:
        if conn.sock.fileno() < 0:
            return
        self._conns.pop(conn.sock.fileno(), None)
        self._per_client[conn.client] -= 1
        if self._per_client[conn.client] <= 0:
            del self._per_client[conn.client]
        if conn.state != BUSY:
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
        elif conn.state == LINGER:
            pass  # dropped: the answer is sent, the connection is closing
        else:
            conn.buf += data
            self._take(conn)

    def _take(self, conn: Conn) -> None:
        """Dispatch the request complete in the buffer, or refuse one that cannot be served."""
        try:
            request = conn.take(self.max_body)
        except HttpError as exc:
            self._send(conn, self.app.refuse(exc), True)
            return
        if request is not None:
            self._dispatch(conn, request)

    def _dispatch(self, conn: Conn, request: Request) -> None:
        if self.app.cheap(request):
            self._send(conn, *self.app.answer(request))
            return
        if self._workers.queued >= self._workers.max_queued:
            self._send(conn, self.app.refuse(HttpError(503, "busy; try again", {"Retry-After": "1"}, close=True)), True)
            return
        conn.state = BUSY
        self._sel.unregister(conn.sock)
        self._workers.submit(conn, request)

    def _woken(self, sock: socket.socket, _: int) -> None:
        for conn, data, close in self._workers.answers():
            if conn.open:
                conn.state = READ
                self._sel.register(conn.sock, selectors.EVENT_READ, self._readable)
                self._send(conn, data, close)

    # --- answers -------------------------------------------------------------------------

    def _send(self, conn: Conn, data: bytes, close: bool) -> None:
        conn.out = memoryview(data)
        conn.state = WRITE if not close else LINGER
        if close:
            conn.buf.clear()
        self._flush(conn, first=True)

    def _flush(self, conn: Conn, first: bool = False) -> None:
        sent = try_send(conn.sock, conn.out)
        if sent < 0:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        closing = conn.state == LINGER
        if conn.out:
            if first:
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, self._writable)
                self._deadlines.set(conn, self.request_timeout)
            return
        if not first:
            self._sel.modify(conn.sock, selectors.EVENT_READ, self._readable)
        if closing:
            self._linger(conn)
            return
        conn.state = READ
        self._deadlines.set(conn, self.request_timeout)
        if conn.buf:
            self._take(conn)  # a pipelined request already arrived

    def _writable(self, sock: socket.socket, _: int) -> None:
        conn = self._conns.get(sock.fileno())
        if conn is not None:
            self._flush(conn)

    def _linger(self, conn: Conn) -> None:
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        self._deadlines.set(conn, LINGER_SECONDS)


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

