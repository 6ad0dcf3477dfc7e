"""Who holds a connection to the HTTP server: accepting from the listeners, each client's share, eviction when
the server is full or its input buffers reach their budget, the pause when out of file descriptors, and closing
(which frees what the connection held). Runs on the event loop's thread; never blocks.
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from collections.abc import Callable

from agent.http.http_connection import BUSY, Conn, Deadlines, Drops, Table
from agent.http.peer_owner import PeerOwners
from agent.telemetry import logs


class Admission:
    """Accepts, caps, evicts and closes the loop's connections (`Table` counts them)."""

    def __init__(self, sel: selectors.BaseSelector, listeners: list[socket.socket], conns: Table,
                 deadlines: Deadlines, dropped: Drops, request_timeout: float,
                 on_readable: Callable[[socket.socket, int], None], on_accepted: Callable[[Conn], None]) -> None:
        self.sel, self.listeners, self.conns = sel, listeners, conns
        self.deadlines, self.dropped, self.request_timeout = deadlines, dropped, request_timeout
        self.on_readable, self.on_accepted = on_readable, on_accepted
        self.owners = PeerOwners()
        self.log = logs.get("server")
        self.paused = False
        self.stopping = False
        for sock in listeners:
            sock.setblocking(False)
            self.sel.register(sock, selectors.EVENT_READ, self.accept)

    def accept(self, listener: socket.socket, _: int) -> None:
        """Accept what is waiting (up to 64 at a time); each new connection is handed to `on_accepted`."""
        for _ in range(64):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: make room, or stop accepting until one closes
                self.log.warning("http.accept_failed", error=str(exc), open_connections=len(self.conns))
                if exc.errno in (errno.EMFILE, errno.ENFILE) and not self.evict():
                    self.pause(True)
                return
            try:
                conn = Conn.accepted_from(sock, addr, self.conns.buffered, time.monotonic(), self.owners)
            except OSError:  # gone before it could be set up
                sock.close()
                continue
            if self.conns.over_share(conn):
                self.dropped("per_client", conn.who, len(self.conns))
                sock.close()
                continue
            if self.conns.full and not self.evict():
                sock.close()
                continue
            self.conns.add(conn)
            self.sel.register(sock, selectors.EVENT_READ, self.on_readable)
            self.deadlines.set(conn, self.request_timeout)
            self.on_accepted(conn)

    def evict(self) -> bool:
        """Make room for a connection (see `Table.to_evict`); False when there is none to close."""
        victim = self.conns.to_evict()
        if victim is None:
            return False
        self.dropped("evicted", victim.who, len(self.conns))
        self.close(victim)
        return True

    def make_room(self, size: int) -> None:
        """Close the connections holding the largest buffers until `size` more bytes fit in the budget."""
        while (largest := self.conns.to_shrink(size)) is not None:
            self.dropped("memory", largest.who, len(self.conns))
            self.close(largest)

    def close(self, conn: Conn) -> None:
        """Close `conn` and forget it (its share and buffer are freed); a second call does nothing."""
        if conn.sock.fileno() < 0:
            return
        self.conns.remove(conn)
        if conn.state != BUSY:
            try:
                self.sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass  # never registered: it failed on its way in
        conn.sock.close()
        self.pause(False)

    def pause(self, paused: bool) -> None:
        """Stop (or resume) accepting: a listener that cannot accept would otherwise wake the loop at once, forever."""
        if paused == self.paused or self.stopping:
            return
        self.paused = paused
        for sock in self.listeners:
            if paused:
                self.sel.unregister(sock)
            else:
                self.sel.register(sock, selectors.EVENT_READ, self.accept)
