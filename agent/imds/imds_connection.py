"""HTTP/1.1 to IMDS over a plain socket: prebuilt request bytes, one deadline per exchange, bounded answers.

The poll is the daemon's only periodic work, so its path is short: the request is bytes built once,
the socket is kept open between polls, and `http.client`'s parser reads the answer. The socket is
opened to the endpoint's own address with `socket.create_connection`: no proxy variable is ever
consulted (IMDS must not be reached through a proxy). Every read and write is given only the time
left until the exchange's deadline, so an IMDS that trickles one byte every few seconds cannot
hold a poll past its timeout; the body is refused past `max_body` bytes before it is all read.
Interim answers (any 1xx: 103 Early Hints, 102 Processing, 100 Continue) are skipped within the same
deadline; `http.client` alone skips only 100.
"""

from __future__ import annotations

import io
import socket
import time
from dataclasses import dataclass
from email.message import Message
from typing import Any
from urllib.parse import urlsplit

from agent import deferred

deferred.defer("ssl")  # http.client imports it for HTTPS only: IMDS is plain HTTP (decision 0220)
import http.client  # noqa: E402

from agent.errors import AnswerTooLarge, ExchangeTimeout  # noqa: E402

CONNECT_TIMEOUT = 5.0
"""Seconds at most to open the connection (the rest of the deadline is for the answer)."""
MAX_HEADER_VALUE = 256
"""Longest header value maintd sends back (ETag): a longer one is not echoed."""


class _Closed(ConnectionResetError):
    """The server reset or closed the connection before the first byte of an answer."""


@dataclass(frozen=True)
class Reply:
    """One HTTP answer, read whole: status, headers, body (at most the caller's `max_body` bytes)."""

    status: int
    headers: Message
    body: bytes

    def header(self, name: str) -> str:
        """A header's value, "" when absent."""
        return self.headers.get(name, "") or ""


def request_bytes(method: str, host: str, target: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    """An HTTP/1.1 request as it goes on the wire; raises ValueError on a value that would split a line."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    if body or method != "GET":
        lines.append(f"Content-Length: {len(body)}")
    if any(c in line for line in lines for c in "\r\n\0"):
        raise ValueError("CR, LF or NUL in a request line or header")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def safe_header_value(value: str) -> str | None:
    """`value` if it can be sent back in a header (short, printable), else None."""
    if len(value) > MAX_HEADER_VALUE or not value.isprintable():
        return None
    return value


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes, each read given only the time left until the deadline; counts what it read."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self.received = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        self._sock.settimeout(_left(self._deadline))
        n = self._sock.recv_into(buffer)
        self.received += n
        return n

    def makefile(self, mode: str) -> io.BufferedReader:
        """What `http.client.HTTPResponse` asks of a socket."""
        return io.BufferedReader(self)


class _Response(http.client.HTTPResponse):
    """`http.client`'s answer parser, skipping every interim 1xx answer as it skips 100 Continue (its
    headers too, at most 100 of them each); the deadline bounds how many can come."""

    def _read_status(self) -> tuple[str, int, str]:
        version, status, reason = super()._read_status()  # type: ignore[misc]
        return version, http.client.CONTINUE if 100 <= status < 200 else status, reason


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ExchangeTimeout("deadline passed")
    return left


class Connection:
    """One keep-alive connection to `endpoint` (http://host[:port]); not thread-safe, one owner.

    A connection the server has closed while idle is noticed before the next request (it has EOF or
    stray bytes to read) and opened again; any failure mid-exchange closes it, so the next exchange
    starts on a fresh one.
    """

    def __init__(self, endpoint: str) -> None:
        url = urlsplit(endpoint)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"IMDS endpoint must be http://host[:port], got {endpoint!r}")
        self.host = url.hostname
        self.port = url.port or 80
        self.host_header = url.netloc
        self._sock: socket.socket | None = None
        self._interrupted = False

    def close(self) -> None:
        """Close the socket (the next exchange opens a new one)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def interrupt(self) -> None:
        """Cut the exchange under way short: it fails at once (safe from a signal handler or another thread)."""
        self._interrupted = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # a blocked recv returns EOF, a send fails
            except OSError:
                pass

    def exchange(self, request: bytes, timeout: float, max_body: int) -> Reply:
        """Send `request`, read the whole answer; raises ExchangeTimeout, AnswerTooLarge, OSError or
        http.client.HTTPException.

        Everything (connect, send, status line, headers, body) happens within `timeout` seconds. A kept
        connection that turns out to be closed by the server (reset, or closed before an answer: the
        race every keep-alive client has with an idle timeout) is replaced once, within the same deadline.
        """
        deadline = time.monotonic() + timeout
        self._interrupted = False
        reused = self._drop_if_closed()
        try:
            return self._exchange(request, deadline, max_body)
        except _Closed:
            if not reused or self._interrupted:
                raise
        return self._exchange(request, deadline, max_body)

    def _drop_if_closed(self) -> bool:
        """Close a kept socket that has something to read (EOF, a reset, stray bytes); whether one is kept."""
        if self._sock is None:
            return False
        try:
            self._sock.settimeout(0)
            self._sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True  # nothing to read: open and idle, as a kept connection should be
        except OSError:
            pass
        self.close()
        return False

    def _exchange(self, request: bytes, deadline: float, max_body: int) -> Reply:
        reader: _DeadlineReader | None = None
        try:
            sock = self._sock or self._connect(deadline)
            sock.settimeout(_left(deadline))
            sock.sendall(request)
            reader = _DeadlineReader(sock, deadline)
            response = _Response(reader)  # type: ignore[arg-type]
            response.begin()
            length = response.length
            if length is not None and length > max_body:
                raise AnswerTooLarge(f"{length} bytes announced, more than the {max_body} accepted")
            body = response.read(max_body + 1)
            if len(body) > max_body:
                raise AnswerTooLarge(f"more than the {max_body} bytes accepted")
            if response.will_close or not response.isclosed():
                self.close()
            return Reply(response.status, response.msg, body)
        except (ConnectionResetError, BrokenPipeError) as exc:  # RemoteDisconnected is a ConnectionResetError
            self.close()
            if reader is None or reader.received == 0:
                raise _Closed(f"closed before an answer: {exc}") from exc
            raise
        except BaseException:
            self.close()
            raise

    def _connect(self, deadline: float) -> socket.socket:
        # an ASCII host goes to getaddrinfo as bytes: a str loads the idna codec (with stringprep and
        # unicodedata, about 0.15 MB) for the life of the process
        host: Any = self.host.encode() if self.host.isascii() else self.host
        sock = socket.create_connection((host, self.port), min(CONNECT_TIMEOUT, _left(deadline)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        return sock
