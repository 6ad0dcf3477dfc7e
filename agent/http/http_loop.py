"""The HTTP event loop: one thread, stdlib `selectors`, that nobody can starve and that sleeps while idle.

Each connection costs a file descriptor and a small buffer, not a thread. A request must arrive
whole (head and body) within `request_timeout` of the moment the server started waiting for it —
a deadline per request, not per read, so trickling one byte at a time buys nothing. One client
address (from 127.0.0.1 or ::1, one local uid; on the unix socket, one uid) holds at most `per_client`
connections; when `max_connections` are open, a new connection evicts an idle one of the client holding
the most rather than being refused, so a load balancer's probe always gets in (`http_admission`).

A turn answers at most TURN_BUDGET requests in all, one per connection at a time, connections that were
idle first, and a new connection's first request in the turn that accepts it: a flood on many
connections costs the flooder its turns, not the probe. A bug while serving one connection closes that
connection alone (500), never the loop.

Cheap answers (the probe, /healthz) are made on the loop itself, so they never wait for a busy
worker; the rest runs on a small worker pool whose answers come back through a socketpair. The
loop blocks in `select` until a connection, data, the next deadline or `close()`: no periodic
wake-up while idle. A connection's state, parsing and deadlines are `httpconn`'s.
"""

from __future__ import annotations

import collections
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, cast

from agent.errors import HttpError
from agent.http.http_admission import Admission
from agent.http.http_connection import BUSY, LINGER, READ, WRITE, Conn, Deadlines, Drops, Line, Table, try_send
from agent.http.http_wire import MAX_HEAD, Request
from agent.telemetry import logs

TURN_BUDGET = 64
"""Requests answered in one turn of the loop, all connections together, one request per connection at a time
(round-robin): however many connections pipeline, a turn stays short, and a flood costs the flooder its own
turns, never the load balancer's probe."""
RECV_SIZE = 16 * 1024
"""Bytes read from a connection at a time. A connection in line to be served is not read until its turn comes,
so a pipelining client holds about this much of the server's memory per connection, and waits for its answers
(thousands of flooding connections stay within the buffer budget instead of being evicted one by one)."""
MAX_BUFFERED = 32 * 1024 * 1024
"""Bytes of requests still arriving held by all connections together (at least four whole requests):
beyond it the largest buffer is dropped, so many partial heads cannot hold the memory of thousands."""
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
        """Queue `request`; its slot is taken only once the pool holds the job, whatever is raised."""
        self.queued += 1
        taken = False
        try:
            self._pool.submit(self._work, conn, request)
            taken = True
        finally:
            if not taken:
                self.queued -= 1

    def _work(self, conn: Conn, request: Request) -> None:
        answer: tuple[bytes, bool] = (b"", True)  # closes the connection unanswered if `answer` breaks its promise
        try:
            answer = self.answer(request)
        finally:
            self._done.append((conn, *answer))
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
                 per_client: int, max_connections: int, workers: int = 4, max_buffered: int = MAX_BUFFERED,
                 on_drop: Callable[[str], None] = lambda reason: None) -> None:
        self.app = app
        self.request_timeout = request_timeout
        self.max_body = max_body
        self.max_connections = max_connections
        self.log = logs.get("server")
        self._errors = logs.Throttle()
        self._dropped = Drops(on_drop)
        self._conns = Table(per_client, max_connections, max(max_buffered, 4 * (MAX_HEAD + max_body)))
        self._sel = selectors.DefaultSelector()
        self._deadlines = Deadlines()
        self._doors = Admission(self._sel, listeners, self._conns, self._deadlines, self._dropped, request_timeout,
                                self._readable, self._receive)
        self._close = self._doors.close
        self._workers = Workers(workers, app.answer)
        self._sel.register(self._workers.wake_r, selectors.EVENT_READ, self._woken)
        self._line = Line()
        self._stop = False
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
        self._stop = self._doors.stopping = True
        self._workers.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._workers.shutdown()

    # --- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                for key, mask in self._sel.select(0 if self._line else self._deadlines.timeout()):
                    try:
                        key.data(key.fileobj, mask)
                    except Exception as exc:  # a bug costs one connection, never the server
                        self._failed(self._conns.get(cast(socket.socket, key.fileobj).fileno()), exc)
                    if self._stop:
                        break
                self._serve_turn()
                self._expire(time.monotonic())
        finally:
            for conn in self._conns.all():
                self._close(conn)
            for sock in (*self._doors.listeners, self._workers.wake_r, self._workers.wake_w):
                sock.close()
            self._sel.close()

    def _failed(self, conn: Conn | None, exc: Exception) -> None:
        """A bug while serving `conn`: logged (throttled, `http.internal_error`), counted
        (`maintd_http_connections_dropped_total{reason="internal_error"}`), and that connection alone is
        answered 500 (when no answer of it has begun) and closed; every other connection goes on."""
        self._errors.log(self.log.error, type(exc).__name__, "http.internal_error", error=repr(exc), exc_info=True)
        if conn is None or not conn.open:
            return
        self._dropped.on_drop("internal_error")
        try:
            if conn.state == READ:
                self._send(conn, self.app.refuse(HttpError(500, "internal error; see maintd's log "
                                                                "(http.internal_error)", close=True)), True)
                return
        except Exception:  # closed below, whatever broke
            pass
        self._close(conn)

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
                self._failed(conn, exc)

    # --- connections ---------------------------------------------------------------------

    def _readable(self, sock: socket.socket, _: int) -> None:
        conn = self._conns.get(sock.fileno())
        if conn is not None:
            self._receive(conn)

    def _receive(self, conn: Conn) -> None:
        """Read what arrived, and put the connection in line to be served: first in line when it was idle (a
        probe on a new connection), behind the others when it still has requests waiting (a pipelining flood).
        A connection in line is not read until its turn has come."""
        if conn.scheduled:
            return
        try:
            data = conn.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            conn.eof = True
            if conn.state == LINGER:
                self._close(conn)
            else:
                self._line.add(conn)  # pipelined requests sent before the half-close are still answered
        elif conn.state != LINGER:  # a closing connection's bytes are dropped: its answer is sent
            idle = not conn.buf
            self._doors.make_room(len(data))
            if conn.open:
                conn.feed(data)
                self._line.add(conn, first=idle)

    def _serve_turn(self) -> None:
        """Answer up to TURN_BUDGET requests, one per connection in line at a time (round-robin), the connections
        that were idle first; a connection with more pipelined requests goes to the back of the line."""
        budget = TURN_BUDGET
        while budget > 0 and self._line:
            conn = self._line.next()
            try:
                if self._serve_one(conn):
                    budget -= 1
                    self._line.add(conn)
            except Exception as exc:
                self._failed(conn, exc)

    def _serve_one(self, conn: Conn) -> bool:
        """Answer (or hand to a worker) the next request complete in `conn`'s buffer; False when there is none."""
        if conn.state != READ or not conn.open:
            return False
        try:
            request = conn.take(self.max_body)
        except HttpError as exc:
            self._send(conn, self.app.refuse(exc), True)
            return True
        if request is None:
            if conn.eof:
                self._close(conn)  # nothing more can arrive
            return False
        self._dispatch(conn, request)
        return True

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
        for conn, data, close in list(self._workers.answers()):  # all taken first: one failing loses no other
            if not conn.open:
                continue
            try:
                conn.state = READ
                self._sel.register(conn.sock, selectors.EVENT_READ, self._readable)
                self._send(conn, data, close)
                self._line.add(conn)  # a pipelined request may already have arrived
            except Exception as exc:
                self._failed(conn, exc)

    # --- answers -------------------------------------------------------------------------

    def _send(self, conn: Conn, data: bytes, close: bool) -> None:
        conn.out = memoryview(data)
        conn.state = WRITE if not close else LINGER
        if close:
            conn.discard()
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

    def _writable(self, sock: socket.socket, _: int) -> None:
        conn = self._conns.get(sock.fileno())
        if conn is not None:
            self._flush(conn)
            self._line.add(conn)  # a pipelined request may already have arrived

    def _linger(self, conn: Conn) -> None:
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        self._deadlines.set(conn, LINGER_SECONDS)
