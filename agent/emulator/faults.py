"""Injected misbehaviour: what can go wrong between a VM and IMDS, and which requests it hits.

Kinds that hold a request back (`latency`, `first_call_delay`, `hang`) combine with one kind that
answers in IMDS's place (`status`, `proxy_504`, `malformed`, `wrong_content_type`, `reset`,
`reset_mid_body`, and the hostile ones: `trickle` sends the true answer one byte every `delay`,
`deep_json` an Events list nested 100 000 deep, `oversize` a valid document padded to 8 MiB).
Spans (`duration`, `delay`) are emulated seconds, scaled by the time scale.
"""

from __future__ import annotations

import http
import threading
from dataclasses import dataclass, field

DELAY_KINDS = ("latency", "first_call_delay", "hang")
ANSWER_KINDS = ("status", "proxy_504", "malformed", "wrong_content_type", "reset", "reset_mid_body", "trickle",
                "deep_json", "oversize")
FAULT_KINDS = DELAY_KINDS + ANSWER_KINDS
ERROR_TEXT = {404: "Not found", 410: "Gone", 429: "Too many requests", 500: "Internal server error",
              503: "Service unavailable"}
PROXY_504 = (b"<html><head><title>504 Gateway Timeout</title></head><body><h1>504 Gateway Timeout</h1>"
             b"<p>The proxy server did not receive a timely response from the upstream server.</p></body></html>")
MALFORMED = b'{"DocumentIncarnation": 7, "Events": [{"EventId": "5E3A'
"""A truncated document (its Content-Length is right: the JSON itself is cut)."""
DEEP_JSON = b'{"DocumentIncarnation": 9, "Events": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
CAPTIVE_PAGE = b"<html><body><h1>Welcome</h1><p>Please sign in to continue.</p></body></html>"


def error_body(status: int) -> dict[str, str]:
    """IMDS's JSON error body for a status."""
    return {"error": ERROR_TEXT.get(status) or http.HTTPStatus(status).phrase}


def oversize() -> bytes:
    """A valid document (no events) padded to 8 MiB, too large for a sane client to read: a client that
    read it would lose every event."""
    return b'{"DocumentIncarnation": 9, "Events": [], "Padding": "' + b"x" * (8 << 20) + b'"}'


@dataclass
class Fault:
    """One injected fault; `count` requests (None: every one) until `until` (clock monotonic; None: cleared).

    `first_call_delay` fires once per VM, and again after each incarnation reset (the 24 h disable).
    """

    kind: str
    vm: str | None = None
    path: str | None = None
    method: str | None = None
    count: int | None = None
    until: float | None = None
    status: int = 503
    delay: float = 1.0
    retry_after: str | None = None
    fired: int = 0
    fired_vms: set[str] = field(default_factory=set)
    cleared: threading.Event = field(default_factory=threading.Event)

    def expired(self, now: float) -> bool:
        return self.cleared.is_set() or (self.until is not None and now >= self.until)

    def applies(self, vm: str, path: str, method: str, now: float) -> bool:
        if self.vm not in (None, vm) or self.method not in (None, method):
            return False
        if self.path is not None and not path.startswith(self.path):
            return False
        if self.expired(now):
            return False
        if self.kind == "first_call_delay":
            return vm not in self.fired_vms
        return self.count is None or self.fired < self.count

    def fire(self, vm: str) -> None:
        self.fired += 1
        self.fired_vms.add(vm)


def make_fault(kind: str, vm: str | None, path: str | None, method: str | None, count: int | None,
               until: float | None, status: int, delay: float, retry_after: float | str | None) -> Fault:
    """A validated Fault; ValueError names the bad parameter."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"kind: unknown fault kind {kind!r}; kinds: {', '.join(FAULT_KINDS)}")
    if path is not None and not (isinstance(path, str) and path.startswith("/")):
        raise ValueError(f"path: expected a path starting with /, got {path!r}")
    if method is not None and not (isinstance(method, str) and method.isalpha()):
        raise ValueError(f"method: expected an HTTP method such as POST, got {method!r}")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"count: expected a whole number >= 1, got {count!r}")
    if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
        raise ValueError(f"status: expected an HTTP error status (400-599), got {status!r}")
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
        raise ValueError(f"delay: expected seconds >= 0, got {delay!r}")
    return Fault(kind, vm, path, method.upper() if method else None, count, until, status, float(delay),
                 None if retry_after is None else str(retry_after))
