"""`probe.mode: tcp`: a port that accepts connections while the VM is in rotation and refuses them
while it is out, for load balancers whose health probe is a plain TCP connect.

The listening socket is closed while out of rotation (a connect then gets RST at once, which the
LB counts as a failed probe without waiting for its timeout) and opened again when the VM is back.
Accepted connections are closed straight away: the handshake is the answer.
"""

from __future__ import annotations

import select
import socket
import threading
from typing import Callable

from agent import logs
from agent.server import parse_listen

CHECK_INTERVAL = 0.2
"""Seconds between two looks at the verdict: how fast the port follows a drain."""


class TcpProbe:
    """Serves the TCP probe on its own thread; `in_rotation` is read every CHECK_INTERVAL."""

    def __init__(self, listen: str, in_rotation: Callable[[], bool]) -> None:
        self.host, self.port = parse_listen(listen)
        self.in_rotation = in_rotation
        self.log = logs.get("tcpprobe")
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def listening(self) -> bool:
        """Whether the port accepts connections now."""
        return self._sock is not None

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

    def step(self) -> None:
        """Follow the verdict: open or close the port, then accept what is waiting."""
        wanted = self.in_rotation()
        if wanted and self._sock is None:
            try:
                self._open()
            except OSError as exc:
                self.log.error("probe.tcp_bind_failed", host=self.host, port=self.port, error=str(exc))
                return
        elif not wanted:
            self._close()
        if self._sock is None:
            self._stop.wait(CHECK_INTERVAL)
            return
        ready, _, _ = select.select([self._sock], [], [], CHECK_INTERVAL)
        if ready:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.close()

    def start(self) -> None:
        """Open the port (if in rotation) and serve on a daemon thread."""
        self.step()
        self._thread = threading.Thread(target=self._serve, name="tcpprobe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.step()

    def stop(self) -> None:
        """Stop serving and close the port."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * CHECK_INTERVAL + 1)
        self._close()
