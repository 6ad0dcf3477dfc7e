"""Every exception maintd raises on purpose.

    MaintdError
    ├── ConfigError            a config file is refused (carries file:line:col, key, fix)
    │   └── (ConfigValueError  raised by section parsers with a relative key; turned into ConfigError)
    ├── ImdsError              one IMDS call failed (status or transport); never escapes the loop
    │   ├── ImdsRequestRejected  400/405: maintd's request is wrong, retrying will not help
    │   └── ImdsUnavailable      connection error, timeout, 404/410/429/5xx: transient
    ├── StateError             the state file could not be read or written
    ├── HttpError              an HTTP request to maintd's server gets an error answer (status, headers)
    ├── ExchangeTimeout (TimeoutError)  an HTTP exchange (IMDS, a peer, gate or webhook) missed its deadline
    └── BadInput (ValueError)  input from a party maintd does not control is refused
        ├── UnsafeJson           too large or too deeply nested to parse
        ├── AnswerTooLarge       an answer (IMDS, a peer, gate or webhook) over the caller's byte cap
        ├── DocumentError        a Scheduled Events document unusable as a whole
        └── HealthReportRefused  a health report the store will not keep
            ├── StaleReport, ReservedSource, TooManyReports

Private control-flow exceptions inside one module (`_PositionedError`, `_Retryable`, `_Closed`) stay
where they are raised; the IMDS client turns whatever its connection raises into an `ImdsError`.
"""

from __future__ import annotations

import contextlib


class MaintdError(Exception):
    """Base of every maintd exception."""


class ConfigValueError(MaintdError, ValueError):
    """A value inside a config section is wrong.

    `key` is relative to the value being parsed (``"schedule.hours[0]"``, ``""`` for the value itself);
    the loader prefixes it with the section path and finds the line and column.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message

    def under(self, prefix: str) -> ConfigValueError:
        """The same error with `prefix` put in front of its key."""
        if not prefix:
            return self
        if not self.key:
            key = prefix
        elif self.key.startswith("["):
            key = prefix + self.key
        else:
            key = f"{prefix}.{self.key}"
        return ConfigValueError(key, self.message)


class ConfigError(MaintdError):
    """A config file is refused; str() is the line an operator reads."""

    def __init__(self, path: str, line: int | None, column: int | None, key: str, message: str) -> None:
        self.path = path
        self.line = line
        self.column = column
        self.key = key
        self.message = message
        where = path if line is None else f"{path}:{line}:{column}"
        super().__init__(f"{where}: {key}: {message}" if key else f"{where}: {message}")


class ImdsError(MaintdError):
    """One IMDS request failed. `status` is the HTTP status, or None for a transport failure."""

    def __init__(self, message: str, status: int | None = None, body: str = "",
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.retry_after = retry_after

    @property
    def code(self) -> str:
        """The metric label: the HTTP status, or ``error`` for a timeout or connection failure."""
        return str(self.status) if self.status is not None else "error"


class ImdsRequestRejected(ImdsError):
    """IMDS answered 400 or 405: the request itself is wrong (header, api-version, proxy in the path)."""


class ImdsUnavailable(ImdsError):
    """IMDS did not answer usefully for now (timeout, connection error, 404/410/429/5xx, bad body)."""


class StateError(MaintdError):
    """The state store could not be persisted (read-only or full disk)."""


def kept_in_memory() -> contextlib.AbstractContextManager[None]:
    """Around a state store write whose refusal must not stop the caller: what the disk refused stays in
    memory, in effect; the store's writer retries it and the loop's report says so once (`state.write_failed`)."""
    return contextlib.suppress(StateError)


class HttpError(MaintdError):
    """A request that gets an error answer: status, message, extra headers; `close` ends the connection."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, *,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.close = close


class BadInput(MaintdError, ValueError):
    """Input from a party maintd does not control (IMDS, a peer, an HTTP client, a file) is refused."""


class ExchangeTimeout(MaintdError, TimeoutError):
    """A bounded HTTP exchange (`boundedhttp`, or the IMDS connection) did not end, head and body, within its
    deadline."""


class AnswerTooLarge(BadInput):
    """A bounded HTTP exchange's answer (`boundedhttp`, or the IMDS connection) is longer than the caller accepts."""


class UnsafeJson(BadInput):
    """Text refused before parsing: too large or too deeply nested."""


class DocumentError(BadInput):
    """The Scheduled Events document as a whole is unusable (not JSON, not an object, no Events list)."""


class HealthReportRefused(BadInput):
    """A health report the store will not keep."""


class StaleReport(HealthReportRefused):
    """A report's SequenceNumber is not greater than the one already stored for its (SourceId, Property)."""


class ReservedSource(HealthReportRefused):
    """A report's SourceId starts with `System.`, which Service Fabric reserves for its own components."""


class TooManyReports(HealthReportRefused):
    """The store already holds its maximum number of reports; a new (SourceId, Property) is refused."""
