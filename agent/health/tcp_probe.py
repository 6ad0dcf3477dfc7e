"""`probe.mode: tcp`: a port that accepts connections while the VM is in rotation and refuses them
while it is out, for load balancers whose health probe is a plain TCP connect.

The listening socket is closed while out of rotation (a connect then gets RST at once, which the
LB counts as a failed probe without waiting for its timeout) and opened again when the VM is back.
Accepted connections are closed straight away: the handshake is the answer.

Given a `watch` (the `Rotation`), the probe's thread sleeps in `select` until a connection arrives,
the watch says the verdict may have changed (a drain, an undrain, a reload, a health report), or a
health report's TimeToLive runs out: no periodic wake-up. Without one it looks every CHECK_INTERVAL.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable
from typing import Protocol

from agent.net.addresses import parse_listen
from agent.telemetry import logs

CHECK_INTERVAL = 0.2
"""Seconds between two looks at the verdict when nothing announces its changes (no `watch`)."""
BIND_RETRY = 5.0
"""Seconds before trying again to open a port that could not be bound (another process holds it)."""


class Watch(Protocol):
    """What announces the verdict's changes (`agent.health.rotation.Rotation`)."""

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener` after each change that may move the verdict."""

    def recheck_in(self) -> float | None:
        """Seconds until the verdict may change unannounced; None: not before the next announcement."""


class TcpProbe:
    """Serves the TCP probe on its own thread, following `in_rotation` as `watch` announces its changes."""

    def __init__(self, listen: str, in_rotation: Callable[[], bool], watch: Watch | None = None) -> None:
        self.host, self.port = parse_listen(listen)
        self.in_rotation = in_rotation
        self.watch = watch
        self.log = logs.get("tcpprobe")
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bind_failed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        if watch is not None:
            watch.subscribe(self.notify)

    @property
    def listening(self) -> bool:
        """Whether the port accepts connections now."""
        return self._sock is not None

    def notify(self) -> None:
        """The verdict may have changed: wake the probe's thread (thread-safe, never blocks)."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # a wake-up is already pending, or the probe is stopped

    def _open(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(64)
        if self.port == 0:
            self.port = sock.getsockname()[1]
        self._sock = sock
        self.log.info("probe.tcp_listening", host=self.host, port=self.port)

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.log.info("probe.tcp_closed", host=self.host, port=self.port, reason="out of rotation")

    def _timeout(self) -> float | None:
        timeout = CHECK_INTERVAL if self.watch is None else self.watch.recheck_in()
        if self._bind_failed:
            return BIND_RETRY if timeout is None else min(timeout, BIND_RETRY)
        return timeout

    def step(self) -> None:
        """Follow the verdict, then wait for what comes next."""
        self._follow()
        self._wait()

    def _follow(self) -> None:
        """Open or close the port as the verdict says."""
        wanted = self.in_rotation()
        self._bind_failed = False
        if wanted and self._sock is None:
            try:
                self._open()
            except OSError as exc:
                self._bind_failed = True
                self.log.error("probe.tcp_bind_failed", host=self.host, port=self.port, error=str(exc),
                               retry_in_seconds=BIND_RETRY)
        elif not wanted:
            self._close()

    def _wait(self) -> None:
        """Wait for a connection (accepted and closed), an announced change or the next recheck."""
        waiting = [self._wake_r] if self._sock is None else [self._wake_r, self._sock]
        poll = select.poll()  # not select(): it fails on a descriptor over 1023, which a busy daemon reaches
        for sock in waiting:
            poll.register(sock, select.POLLIN)
        timeout = self._timeout()
        ready = {fd for fd, _ in poll.poll(None if timeout is None else max(0.0, timeout) * 1000)}
        if self._wake_r.fileno() in ready:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
        if self._sock is not None and self._sock.fileno() in ready:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.close()

    def start(self) -> None:
        """Open the port (if in rotation) and serve on a daemon thread."""
        self._follow()
        self._thread = threading.Thread(target=self._serve, name="tcpprobe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._wait()
            self._follow()

    def stop(self) -> None:
        """Stop serving and close the port."""
        self._stop.set()
        self.notify()
        if self._thread is not None:
            self._thread.join(2 * CHECK_INTERVAL + 1)
        self._close()
        self._wake_r.close()
        self._wake_w.close()
