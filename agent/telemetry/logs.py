"""structlog setup (the one place that touches structlog's global configuration) and repeat limiting
(`RepeatLimiter` for one failure streak, `Throttle` for lines anyone can trigger again and again).

JSON lines by default, a console renderer when stderr is a TTY (`log.format: auto`). Under
journald (`$JOURNAL_STREAM` set) each JSON line is prefixed with its syslog priority (`<3>` for
errors ...), so `journalctl -p err -u maintd` filters and `journalctl -o cat -u maintd | jq` reads.
Event names are stable (`poll.failed`, `event.appeared`, ...): operators alert on them.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from agent import deferred

deferred.defer("asyncio")  # structlog imports it for its async methods only, which maintd never calls
import structlog  # noqa: E402

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}


class _JournaldJSON:
    """JSON renderer that prefixes each line with `<N>`, the syslog priority journald strips and files."""

    def __init__(self) -> None:
        self._json = structlog.processors.JSONRenderer()

    def __call__(self, logger: Any, name: str, event_dict: Any) -> str:
        prio = _PRIORITY.get(str(event_dict.get("level", "info")), 6)
        rendered = self._json(logger, name, event_dict)
        return f"<{prio}>{rendered.decode() if isinstance(rendered, bytes) else rendered}"


def configure(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog for the process (called at start and on reload)."""
    stream = stream or sys.stderr
    console = fmt == "console" or (fmt == "auto" and stream.isatty())
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if console:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    else:
        renderer = _JournaldJSON() if os.environ.get("JOURNAL_STREAM") else structlog.processors.JSONRenderer()
        processors += [structlog.processors.dict_tracebacks, renderer]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def get(name: str = "maintd") -> Any:
    """A bound logger (`logger` field set to `name`)."""
    return structlog.get_logger().bind(logger=name)


@dataclass
class RepeatLimiter:
    """Log a repeated error once, then a summary at most every `every` seconds, then the recovery.

    Pure bookkeeping: the caller passes the monotonic time and does the logging.
    """

    every: float = 300.0
    count: int = 0
    first_at: float | None = None
    last_summary: float | None = None
    last_key: str | None = None

    def failure(self, key: str, now: float) -> str | None:
        """`"first"` to log this failure in full, `"summary"` to log a summary, None to stay quiet."""
        if self.last_key != key:
            self.count, self.first_at, self.last_summary, self.last_key = 1, now, now, key
            return "first"
        self.count += 1
        if self.last_summary is not None and now - self.last_summary >= self.every:
            self.last_summary = now
            return "summary"
        return None

    def success(self) -> int:
        """Reset; returns how many failures the streak had (0 when there was none)."""
        count = self.count
        self.count, self.first_at, self.last_summary, self.last_key = 0, None, None, None
        return count


class Throttle:
    """At most one log line per key every `every` seconds: the first in full, then one line now and then
    saying how many were left out. For errors a client can provoke at will (a flood must not fill the
    disk). Keys must come from a bounded set (event names, exception types), never from client data.
    """

    def __init__(self, every: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self._last: dict[str, tuple[float, int]] = {}

    def __call__(self, key: str) -> int | None:
        """None to stay quiet; else log now, with this many left out since the last line of `key`."""
        now = self.clock()
        last, left_out = self._last.get(key, (float("-inf"), 0))
        if now - last < self.every:
            self._last[key] = (last, left_out + 1)
            return None
        self._last[key] = (now, 0)
        return left_out

    def log(self, method: Callable[..., Any], key: str, event: str, **fields: Any) -> None:
        """`method(event, more_since_last_line=..., **fields)` unless `key` was logged within `every` seconds."""
        left_out = self(key)
        if left_out is not None:
            method(event, more_since_last_line=left_out, **fields)
