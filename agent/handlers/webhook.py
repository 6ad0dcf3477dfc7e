"""`webhook`: tell people (Slack, Teams) or systems (any HTTP endpoint) about an event's phases.

The URL comes from `url` or from `url_file` (read at every run, so a rotated secret is picked up);
neither is ever logged or put in a result beyond its scheme and host, and request errors are named
by type only, because their text quotes the URL. Presets: `generic` posts the payload hooks get on
stdin; `slack` posts `{"text": line}`; `teams` posts the line as an Adaptive Card message, the one
format both Teams Workflows ("When a Teams webhook request is received", which refuses the old
MessageCard) and the retiring Office 365 connectors accept. The line reads "Reboot of vm-3 not
before 14:05 UTC (in 9 min), approved by vm-1". `template` renders your own body from a fixed set
of fields, without attribute or index access; a template that is JSON gets its values JSON-escaped,
so a quote in a Description cannot break it.

`post` is the one retrying POST of the handlers (the `health` handler's Service Fabric push uses it
too): connection errors, timeouts, 429 and 5xx are retried with exponential backoff and jitter
(longer when a 429 says Retry-After), and neither a wait nor a request reaches past the run's
budget. Each try is a `boundedhttp` exchange: its whole answer must come within the try's timeout,
and only the first 64 KiB of the body are read (an endless or trickling endpoint cannot hold a
handler past its budget or grow the daemon's memory). Unlike IMDS calls, webhooks honour the proxy
environment (HTTPS_PROXY, NO_PROXY). Redirects are never followed: `requests` would carry the body
and the custom (often secret) headers to whatever host a 307 names, so a 3xx is a failed POST that
names the status.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import requests

from agent import __version__
from agent.errors import ConfigValueError
from agent.handlers.base import FAILED, OK, Context, Handler, Result
from agent.model.approval import APPROVAL_KEY, approved_by
from agent.model.config_schema import choice, duration, integer, mapping_of, opt, optional, text
from agent.model.outcomes import PHASE_SCHEDULED, PHASE_STARTED
from agent.model.timefmt import iso_z
from agent.model.tracker import CANCELED
from agent.net import boundedhttp
from agent.net.boundedhttp import Reply
from agent.net.httpdates import retry_after, transient_status
from agent.retry import retrying
from agent.telemetry import logs
from agent.trust.pathtrust import first_problem

TEMPLATE_FIELDS = ("event_id", "event_type", "status", "vm", "resources", "not_before", "phase", "description",
                   "source", "duration_seconds", "outcome", "approved_by", "text")
MIN_ATTEMPT = 0.5
MAX_REPLY_BYTES = 64 * 1024
"""The most of an endpoint's answer read (only its status and first 200 characters are used)."""
"""Seconds a request gets at least: no retry starts with less than this left of the budget."""


class _SafeFormatter(string.Formatter):
    """str.format without attribute or index access: `{event_id.__class__}` is refused."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Any:
        if not field_name.isidentifier():
            raise ValueError(f"field {field_name!r}: only plain names are allowed")
        return super().get_field(field_name, args, kwargs)


def _template(value: Any) -> str:
    tpl = text()(value)
    try:
        parts = list(string.Formatter().parse(tpl))
    except ValueError as exc:
        raise ConfigValueError("", f"not a valid template: {exc}") from None
    unknown = sorted({name for _, name, _, _ in parts if name is not None and name not in TEMPLATE_FIELDS})
    if unknown:
        raise ConfigValueError("", f"unknown field {{{unknown[0]}}}; fields: {', '.join(TEMPLATE_FIELDS)} "
                               "(no attribute or index access)")
    if any(spec and "{" in spec for _, _, spec, _ in parts):
        raise ConfigValueError("", "a field's format spec cannot contain another field")
    try:
        _SafeFormatter().vformat(tpl, (), dict.fromkeys(TEMPLATE_FIELDS, "x"))
    except ValueError as exc:
        raise ConfigValueError("", f"not a valid template: {exc}") from None
    return cast(str, tpl)


@dataclass(frozen=True)
class WebhookOptions:
    url: str | None = opt(optional(text(r"^https?://\S+$", "an http(s) URL")), None, "where to POST")
    url_file: str | None = opt(optional(text(r"^/", "an absolute path")), None,
                               "file holding the URL (keeps a secret URL out of the config; read at every run)")
    preset: str = opt(choice("generic", "slack", "teams"), "generic",
                      "generic: the event JSON; slack, teams: one readable line")
    template: str | None = opt(optional(_template), None,
                               "your own body, with {fields}: " + ", ".join(TEMPLATE_FIELDS))
    headers: dict[str, str] = opt(mapping_of(text()), {}, "extra request headers")
    retries: int = opt(integer(0, 20), 3, "retries after a connection error, timeout, 429 or 5xx")
    request_timeout: float = opt(duration(0.1, 300), 10.0, "timeout of one whole request (answer head and body)")

    def validate(self) -> None:
        if (self.url is None) == (self.url_file is None):
            raise ConfigValueError("url", "set exactly one of url and url_file")
        problem = _url_file_problem(self.url_file)
        if problem:
            raise ConfigValueError("url_file", problem)


def _url_file_problem(path: str | None) -> str | None:
    """Why another user could choose where the webhook (its body and `headers`) goes: `path` or a directory above
    it is theirs or writable by them (`agent.trust.pathtrust`); None when not (or no url_file)."""
    problem = first_problem(path) if path else None
    return problem and f"{problem} (another user could send this webhook, its headers too, where they like)"


# --- the body ------------------------------------------------------------------------------

def _span(seconds: float) -> str:
    if seconds <= 0:
        return "due now"
    if seconds < 90:
        return f"in {round(seconds)} s"
    if seconds < 5400:
        return f"in {round(seconds / 60)} min"
    return f"in {seconds / 3600:.1f} h"


def readable(ctx: Context, now: datetime, approved_by: str | None) -> str:
    """One line for people: what, which VM(s), when, who approved."""
    e = ctx.event
    who = f"{e.event_type} of {ctx.vm_name if ctx.names_self and ctx.vm_name else ', '.join(e.resources)}"
    if ctx.phase == PHASE_SCHEDULED:
        when = ""
        if e.not_before is not None:
            when = f" not before {e.not_before:%H:%M} UTC ({_span((e.not_before - now).total_seconds())})"
        line = f"{who}{when}"
    elif ctx.phase == PHASE_STARTED:
        line = f"{who} has started"
    else:
        line = f"{who} was canceled" if ctx.outcome == CANCELED else f"{who} is over"
    if approved_by:
        line += f", approved by {approved_by}"
    if e.description and ctx.phase == PHASE_SCHEDULED:
        line += f" — {e.description}"
    return line


def render(template: str, fields: dict[str, str]) -> tuple[bytes, str]:
    """A template's body and content type: JSON with escaped values when the template is JSON, else text."""
    escaped = _SafeFormatter().vformat(template, (), {k: json.dumps(v, ensure_ascii=False)[1:-1]
                                                      for k, v in fields.items()})
    try:
        if isinstance(json.loads(escaped), (dict, list)):
            return escaped.encode(), "application/json"
    except ValueError:
        pass
    return _SafeFormatter().vformat(template, (), fields).encode(), "text/plain; charset=utf-8"


# --- the POST ------------------------------------------------------------------------------

class _Retryable(Exception):
    """An answer worth trying again (429, 5xx)."""

    def __init__(self, response: Reply) -> None:
        super().__init__(f"answered {response.status}")
        self.response = response


@dataclass(frozen=True)
class Answer:
    """How a POST ended: the last response (None when none came), the error otherwise, the tries made."""

    response: Reply | None
    error: str
    tries: int


def target(url: str) -> str:
    """What of a URL may be logged: scheme and host (the path and query of a webhook URL are its secret)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}"


def _asked_wait(state: Any, now: datetime, left: float) -> float:
    """What the last answer's Retry-After asks for (ASCII digits or an HTTP-date, at most `left`), else 0."""
    exc = state.outcome.exception() if state.outcome is not None else None
    asked = retry_after(exc.response.headers.get("Retry-After"), now, left) if isinstance(exc, _Retryable) else None
    return asked or 0.0


def _transient(exc: BaseException) -> bool:
    """Worth another try: 429/5xx, a timeout, a connection error other than TLS (a bad certificate stays bad)."""
    if isinstance(exc, requests.exceptions.SSLError):
        return False
    return isinstance(exc, (_Retryable, requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError))


def post(ctx: Context, session: requests.Session, url: str, *, attempts: int, request_timeout: float,
         **kwargs: Any) -> Answer:
    """POST `url` within `ctx.timeout`, up to `attempts` tries, retrying what `_transient` admits.

    Request errors are named by type only: their text quotes the URL, which may be a secret.
    """
    clock = ctx.clock
    deadline = clock.monotonic() + ctx.timeout
    tries = 0

    def send() -> Reply:
        nonlocal tries
        tries += 1
        left = max(MIN_ATTEMPT, deadline - clock.monotonic())
        response = boundedhttp.exchange(session, "POST", url, timeout=min(request_timeout, left),
                                        max_bytes=MAX_REPLY_BYTES, truncate=True, **kwargs)
        if transient_status(response.status):
            raise _Retryable(response)
        return response

    retry = retrying(clock, retry_if=_transient, attempts=attempts, within=max(0.0, ctx.timeout - MIN_ATTEMPT),
                     cancel=ctx.cancel)
    backoff = retry.wait
    def wait(state: Any) -> float:
        left = max(0.0, deadline - clock.monotonic() - MIN_ATTEMPT)
        return min(max(backoff(state), _asked_wait(state, clock.now(), left)), left)

    retry = retry.copy(wait=wait)
    try:
        response = retry(send)
    except _Retryable as exc:
        return Answer(exc.response, "", tries)
    except (requests.RequestException, ConnectionError, TimeoutError) as exc:
        return Answer(None, type(exc).__name__, tries)
    if response.is_redirect:
        return Answer(None, f"answered {response.status}, a redirect (not followed)", tries)
    return Answer(response, "", tries)


# --- the handler ---------------------------------------------------------------------------

class WebhookHandler(Handler):
    type_name = "webhook"
    Options = WebhookOptions

    def _url(self) -> str:
        if self.options.url:
            return cast(str, self.options.url)
        assert self.options.url_file is not None
        problem = _url_file_problem(self.options.url_file)
        if problem:
            raise ValueError(f"url_file {self.options.url_file} refused: {problem}")
        try:
            url = Path(self.options.url_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"url_file {self.options.url_file} cannot be read: {reason}") from None
        if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
            raise ValueError(f"url_file {self.options.url_file} does not hold one http(s) URL")
        return url

    def _approved_by(self, ctx: Context) -> str | None:
        """Who approved the event, when known here (ctx says so, or this VM sent the approval)."""
        if ctx.approved_by:
            return ctx.approved_by
        return approved_by(self.services.store.result(ctx.event.event_id, APPROVAL_KEY))

    def body(self, ctx: Context) -> tuple[bytes, str]:
        """The request body and its content type, for the preset or template."""
        approved_by = self._approved_by(ctx)
        line = readable(ctx, ctx.clock.now(), approved_by)
        if self.options.template is not None:
            e = ctx.event
            return render(self.options.template, {
                "event_id": e.event_id, "event_type": e.event_type, "status": e.status, "vm": ctx.vm_name,
                "resources": ",".join(e.resources), "phase": ctx.phase, "description": e.description,
                "not_before": iso_z(e.not_before) if e.not_before else "",
                "source": e.source, "duration_seconds": str(e.duration_seconds), "outcome": ctx.outcome or "",
                "approved_by": approved_by or "", "text": line})
        if self.options.preset == "slack":
            return json.dumps({"text": line}).encode(), "application/json"
        if self.options.preset == "teams":
            card = {"type": "AdaptiveCard", "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
                    "version": "1.4", "body": [{"type": "TextBlock", "text": line, "wrap": True}]}
            return json.dumps({"type": "message", "text": line, "attachments": [
                {"contentType": "application/vnd.microsoft.card.adaptive", "contentUrl": None, "content": card}]}
            ).encode(), "application/json"
        return ctx.payload_json(), "application/json"

    def _post(self, ctx: Context) -> Result:
        try:
            url = self._url()
        except ValueError as exc:
            return Result(FAILED, str(exc))
        where = target(url)
        data, content_type = self.body(ctx)
        headers = {"Content-Type": content_type, "User-Agent": f"maintd/{__version__}", **self.options.headers}
        with boundedhttp.session() as session:
            answer = post(ctx, session, url, attempts=self.options.retries + 1,
                          request_timeout=self.options.request_timeout, data=data, headers=headers)
        tries = f" after {answer.tries} attempts" if answer.tries > 1 else ""
        r = answer.response
        if r is not None and r.status < 400:
            return Result(OK, f"{where} answered {r.status}{tries}")
        error = f"{where}: {answer.error}" if r is None else f"{where} answered {r.status}"
        logs.get("webhook").warning("webhook.failed", handler=self.spec.name, event_id=ctx.event.event_id,
                                    phase=ctx.phase, target=where, attempts=answer.tries, error=error)
        return Result(FAILED, error + tries + (f": {r.text[:200]}" if r is not None and r.text else ""))

    def scheduled(self, ctx: Context) -> Result:
        return self._post(ctx)

    def started(self, ctx: Context) -> Result:
        return self._post(ctx)

    def completed(self, ctx: Context) -> Result:
        return self._post(ctx)
