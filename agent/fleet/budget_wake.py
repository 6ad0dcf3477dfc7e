"""Wake hints of the disruption budget: a member whose write handed a place to a waiter tells it so, at once.

Blob storage has no watch. The handoff (`budget_rules.grant`) seats the next member in the releaser's own
write; the members next in line read the record every second (B4), and the releaser also POSTs
`{address}/v1/budget/wake`, an accelerator only, so the member reads the record at once. The address is what this
VM's own configuration derives for the member's name (`coordination.budget.wake_url`, the `address` function the
wiring hands in), never the `url` of its entry in the record: the hint carries the coordination token, and the
record is data anyone with write access to the container could have written (B5). A hint carries no authority
either: the member acts only on what it reads in the store, so a forged, late or lost hint costs at most a read.
Sending runs on its own worker lanes with a short timeout (never the loop, never the budget's store lane); a
failure is a debug log and `maintd_budget_wake_hints_total{outcome="failed"}`. Receiving only raises a flag
the loop takes in on its next tick, where reads it causes are at most one per WAKE_GAP.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from agent.fleet.budget_rules import Entry
from agent.lanes import Lanes
from agent.model.fleet_records import FAILED, SENT
from agent.net.addresses import is_loopback_url, parse_listen
from agent.net.httpdates import transient_status
from agent.telemetry import logs

if TYPE_CHECKING:
    import requests

WAKE_PATH = "/v1/budget/wake"
HINT_TIMEOUT = 0.5
"""Seconds one try may take, connect and answer (a member's API answers within milliseconds inside a VNet); a try
that takes longer is sent again (a second hint costs nothing: hints are coalesced)."""
RETRY_AFTER = (0.25, 1.0, 4.0)
"""A hint that met a transient failure (no connection, a timeout, 408/429/5xx) is sent again after these waits
(three more tries, about 7 s in all); a refusal (another 4xx) is not."""
WAKE_GAP = 1.0
"""At most one store read per this many seconds comes from wake hints, however many arrive."""
IMDS_ADDRESS = "169.254.169.254"


class WakeAnswer(TypedDict):
    """`POST /v1/budget/wake`'s answer: whether the hint named this VM (then it reads the record soon)."""

    woken: bool


def advertised(advertise: str, listen: str, local_ip: Callable[[], str | None]) -> str:
    """The base URL this member writes into its entry, shown in the fleet view only ("" none; never an address
    anything is sent to). `advertise`: auto, none or a URL;
    auto: the server's port on the address it listens on, or on this VM's private IP when it listens on every
    address; none when it listens on loopback only (no other VM could reach it)."""
    if advertise == "none":
        return ""
    if advertise != "auto":
        return advertise.rstrip("/")
    host, port = parse_listen(listen)
    if host not in ("0.0.0.0", "::", ""):
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        return "" if is_loopback_url(url) else url
    ip = local_ip()
    return f"http://{ip}:{port}" if ip else ""


def primary_ip() -> str | None:
    """This VM's private IP: the source address of its route towards IMDS (a UDP connect sends no packet)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((IMDS_ADDRESS, 80))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return ip if isinstance(ip, str) and not ip.startswith(("0.", "127.")) else None


class Hinter(Protocol):
    """What the budget needs of `WakeSender` (an in-process stand-in in tests and the bench)."""

    def send(self, group: str, targets: Sequence[Entry]) -> None: ...
    def wait_idle(self, timeout: float) -> bool: ...
    def stop(self) -> None: ...


class WakeSender:
    """Sends wake hints on its own lanes (one per target); thread-safe."""

    def __init__(self, token_reader: Callable[[], str | None], metrics: Any, address: Callable[[str], str | None],
                 timeout: float = HINT_TIMEOUT) -> None:
        """`address`: a member's base URL from its name, as this VM's configuration derives it (None: no hint)."""
        self.token_reader, self.metrics, self.timeout, self.address = token_reader, metrics, timeout, address
        self.log = logs.get("budget")
        self._lanes = Lanes(2, "budget-wake", metrics.lane_errors.labels("budget-wake").inc)
        self._lock = threading.Lock()
        self._session: requests.Session | None = None
        self._stopping = threading.Event()

    def send(self, group: str, targets: Sequence[Entry]) -> None:
        """Hint each of `targets` at the address the configuration derives for its name, never at the `url` its
        entry in the record gives (the loop's or a worker's thread: returns at once)."""
        for t in targets:
            url = self.address(t.vm)
            if url:
                self._lanes.submit(url, functools.partial(self._post, group, t.vm, url))
            else:
                self.log.debug("budget.wake_unaddressed", vm=t.vm, effect="no hint: the member reads the record",
                               reason="coordination.budget.wake_url gives no safe address for this name")

    def _post(self, group: str, vm: str, url: str) -> None:
        """One hint, sent again after each of RETRY_AFTER while its failures are transient (a stop ends the waits)."""
        error, tries = None, 0
        for wait in (0.0, *RETRY_AFTER):
            if wait and self._stopping.wait(wait):
                break
            error, transient = self._attempt(group, vm, url)
            tries += 1
            if error is None or not transient:
                break
        self.metrics.budget_wake.labels(FAILED if error else SENT).inc()
        if error:
            self.log.debug("budget.wake_failed", vm=vm, url=url, error=error, tries=tries,
                           effect="the member reads the record on its fallback poll")

    def _attempt(self, group: str, vm: str, url: str) -> tuple[str | None, bool]:
        """(None, _) when the member took the hint, else (what went wrong, whether asking again may help)."""
        from agent.net import boundedhttp

        with self._lock:
            if self._session is None:
                self._session = boundedhttp.session(4, trust_env=False)
            session = self._session
        token = self.token_reader()
        try:
            r = boundedhttp.exchange(session, "POST", url + WAKE_PATH, timeout=self.timeout, max_bytes=4096,
                                     truncate=True, json={"group": group, "vm": vm},
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
        except Exception as exc:  # a hint is best effort: nothing it met may stop the lane
            return f"{type(exc).__name__}: {str(exc)[:120]}", True
        if 200 <= r.status < 300:
            return None, False
        return f"answered {r.status}", transient_status(r.status)

    def wait_idle(self, timeout: float) -> bool:
        return self._lanes.wait_idle(timeout)

    def stop(self) -> None:
        self._stopping.set()
        self._lanes.shutdown()
        with self._lock:
            if self._session is not None:
                self._session.close()
