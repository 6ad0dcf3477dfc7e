"""sd_notify over `$NOTIFY_SOCKET` and `LISTEN_FDS` socket activation, with the stdlib only.

A no-op outside systemd. The watchdog is pinged from the main loop after each healthy tick (a
side thread would keep pinging while the loop hangs, defeating the watchdog).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

SD_LISTEN_FDS_START = 3
T = TypeVar("T")
HOOK_ENV_STRIP = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
"""Variables hooks must not inherit: a child could otherwise ping or confuse systemd."""


class Notifier:
    """Sends sd_notify datagrams; every method is silent when not under systemd."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog_for_us = usec.isdigit() and (not pid or pid == str(os.getpid()))
        self.watchdog_interval: float | None = int(usec) / 2e6 if watchdog_for_us else None
        self._last_ping = float("-inf")

    def send(self, *fields: str) -> bool:
        """Send one datagram of newline-separated fields; False when not under systemd or it failed."""
        if not self.address:
            return False
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto("\n".join(fields).encode(), addr)
            return True
        except OSError:
            return False

    def ready(self, status: str = "") -> None:
        """READY=1 (after the config is loaded and the server listens)."""
        self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> None:
        """RELOADING=1 with MONOTONIC_USEC (ignored by old systemd)."""
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> None:
        """STOPPING=1."""
        self.send("STOPPING=1")

    def status(self, text: str) -> None:
        """STATUS=..., shown by systemctl status."""
        self.send(f"STATUS={text}")

    def watchdog(self, now: float) -> None:
        """WATCHDOG=1, at most every half of WatchdogSec."""
        if self.watchdog_interval is None or now - self._last_ping < self.watchdog_interval:
            return
        self._last_ping = now
        self.send("WATCHDOG=1")


def call_pinging(fn: Callable[[], T], notifier: Notifier, now: Callable[[], float], timeout: float,
                 on_ping: Callable[[], None] = lambda: None) -> T:
    """`fn()`, on this thread when `timeout` fits between two watchdog pings; otherwise on a thread of its
    own while this one keeps pinging (and calls `on_ping`), so a long call never gets maintd killed."""
    ping = notifier.watchdog_interval
    if ping is None or timeout <= ping:
        return fn()
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # handed back to the caller, which raises it
            outcome.append(exc)

    worker = threading.Thread(target=call, name="long-call", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(ping)
        notifier.watchdog(now())
        on_ping()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return cast(T, outcome[0])


def listen_fds(environ: Mapping[str, str] | None = None) -> list[socket.socket]:
    """Sockets passed by systemd socket activation (`maintd.socket`), or [] when none are ours."""
    env = os.environ if environ is None else environ
    if env.get("LISTEN_PID") != str(os.getpid()):
        return []
    count = int(env.get("LISTEN_FDS", "0") or 0)
    return [socket.socket(fileno=SD_LISTEN_FDS_START + i) for i in range(count)]


def system_is_stopping() -> bool:
    """Whether the whole system is shutting down (not a plain restart of maintd).

    `systemctl is-system-running` says `stopping` then; without systemd the answer is no.
    """
    import subprocess

    try:
        out = subprocess.run(["systemctl", "is-system-running"], capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.stdout.strip() == "stopping"
