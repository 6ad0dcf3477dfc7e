"""How an emulated VM's IMDS answers, apart from what it answers: the answer primitives (status,
headers, a right Content-Length, a dropped connection) and the injected faults acted out on a
request — delays, hangs until the client gives up, a trickled answer, and the answers given in
IMDS's place (`faults.py` says which faults exist and which requests they hit).
"""

from __future__ import annotations

import http.server
import io
import json
import select
import socket
from typing import Any
from urllib.parse import SplitResult

from agent.emulator.faults import (
    CAPTIVE_PAGE,
    DEEP_JSON,
    DELAY_KINDS,
    MALFORMED,
    PROXY_504,
    Fault,
    error_body,
    oversize,
)
from agent.emulator.model import RecordedRequest

HANG_POLL = 0.02
"""Seconds between checks of a hanging request (fault cleared or expired, client gone, emulator stopping)."""


class FaultyAnswers(http.server.BaseHTTPRequestHandler):
    """A request handler that answers and misbehaves; the subclass says what IMDS answers (`_imds`)."""

    server: Any  # the VmServer: `emulator` (faults, clock, stopping), `vm`, `reset_on_close`
    _record: RecordedRequest | None = None

    def _imds(self, url: SplitResult, body: bytes) -> None:
        raise NotImplementedError

    # --- answering ---------------------------------------------------------------------------

    def _send(self, status: int, body: bytes, content_type: str = "application/json; charset=utf-8",
              extra: dict[str, str] | None = None) -> None:
        if self._record is not None:
            self._record.status = status  # before the answer leaves: a client may read the record next
        self.send_response(status)
        if status != 304:
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD" and status != 304:
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj, separators=(",", ":")).encode(), extra=extra)

    def _drop(self) -> bool:
        """Close the connection without an answer; False, so `_faults` can return it."""
        self.close_connection = True
        if self._record is not None:
            self._record.status = None
        return False

    # --- faults ------------------------------------------------------------------------------

    def _faults(self, url: SplitResult, body: bytes) -> bool:
        """Act out this request's faults; False when one has answered it or dropped the connection."""
        emu = self.server.emulator
        for fault in emu.take_faults(self.server.vm, url.path, self.command):
            if fault.kind == "hang":
                if not self._hang(fault):
                    return self._drop()
            elif fault.kind in DELAY_KINDS:
                if emu.stopping.wait(emu.model.real(fault.delay)):
                    return self._drop()
            elif fault.kind == "trickle":
                self._trickle(url, body, fault)
                return False
            else:
                self._misbehave(fault)
                return False
        return True

    def _trickle(self, url: SplitResult, body: bytes, fault: Fault) -> None:
        """The true answer, one byte every `delay` (emulated) seconds, until done or the client leaves."""
        emu = self.server.emulator
        real, self.wfile = self.wfile, io.BytesIO()
        try:
            self._imds(url, body)
            answer = self.wfile.getvalue()
        finally:
            self.wfile = real
        for i in range(len(answer)):
            if emu.stopping.wait(emu.model.real(fault.delay)) or self._peer_closed():
                self._drop()
                return
            self.wfile.write(answer[i:i + 1])

    def _hang(self, fault: Fault) -> bool:
        """Answer nothing until the fault is cleared or expires (True: go on) or the client gives up (False)."""
        emu = self.server.emulator
        while not emu.stopping.wait(HANG_POLL):
            if fault.expired(emu.clock.monotonic()):
                return True
            if self._peer_closed():
                return False
        return False

    def _peer_closed(self) -> bool:
        try:
            poll = select.poll()  # not select(): it fails on a descriptor over 1023 (a long test run reaches them)
            poll.register(self.connection, select.POLLIN)
            return bool(poll.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _misbehave(self, fault: Fault) -> None:
        kind = fault.kind
        if kind == "status":
            self._json(fault.status, error_body(fault.status),
                       {"Retry-After": fault.retry_after} if fault.retry_after else None)
        elif kind == "proxy_504":
            self._send(504, PROXY_504, "text/html")
        elif kind == "malformed":
            self._send(200, MALFORMED)
        elif kind == "wrong_content_type":
            self._send(200, CAPTIVE_PAGE, "text/html; charset=utf-8")
        elif kind in ("deep_json", "oversize"):
            self._send(200, DEEP_JSON if kind == "deep_json" else oversize())
        else:
            if kind == "reset_mid_body":
                self.send_response(200)
                self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("Content-Length", "4096")
                self.end_headers()
                self.wfile.write(b'{"DocumentIncarnation": 3, "Events": [')
            self.server.reset_on_close(self.connection)
            self._drop()
