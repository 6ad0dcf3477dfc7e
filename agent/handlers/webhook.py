"""`webhook`: tell people (Slack, Teams) or systems (any HTTP endpoint) about an event's phases.

The URL comes from `url` or from `url_file` (read at every run, so a rotated secret is picked up);
neither is ever logged beyond its scheme and host. Presets: `generic` posts the payload hooks get on
stdin; `slack` and `teams` post one readable line ("Reboot of vm-3 not before 14:05 UTC (in 9 min),
approved by vm-1"); `template` renders your own body from a fixed set of fields. Failures that may
pass (connection errors, timeouts, 429, 5xx) are retried with exponential backoff within the
handler's `timeout`. Unlike IMDS calls, webhooks honour the proxy environment (HTTPS_PROXY).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests

from agent import __version__, logs
from agent.configschema import choice, duration, integer, mapping_of, opt, optional, text
from agent.errors import ConfigValueError
from agent.handlers.base import FAILED, OK, Context, Handler, Result
from agent.retry import retrying

TEMPLATE_FIELDS = ("event_id", "event_type", "status", "vm", "resources", "not_before", "phase", "description",
                   "source", "duration_seconds", "outcome", "approved_by", "text")


class _Retryable(Exception):
    """A webhook answer worth trying again (429, 5xx)."""


def _template(value: Any) -> str:
    tpl = text()(value)
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(tpl) if name is not None}
    except ValueError as exc:
        raise ConfigValueError("", f"not a valid template: {exc}") from None
    unknown = sorted(f for f in fields if f not in TEMPLATE_FIELDS)
    if unknown:
        raise ConfigValueError("", f"unknown field {{{unknown[0]}}}; fields: {', '.join(TEMPLATE_FIELDS)} "
                               "(no attribute or index access)")
    return tpl


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
    request_timeout: float = opt(duration(0.1, 300), 10.0, "timeout of one request")

    def validate(self) -> None:
        if (self.url is None) == (self.url_file is None):
            raise ConfigValueError("url", "set exactly one of url and url_file")


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{max(0, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def readable(ctx: Context, now: datetime, approved_by: str | None) -> str:
    """One line for people: what, which VM, when, who approved."""
    e = ctx.event
    who = f"{e.event_type} of {ctx.vm_name or ', '.join(e.resources)}"
    if ctx.phase == "scheduled":
        when = ""
        if e.not_before is not None:
            when = f" not before {e.not_before:%H:%M} UTC (in {_minutes((e.not_before - now).total_seconds())})"
        line = f"{who}{when}"
    elif ctx.phase == "started":
        line = f"{who} has started"
    else:
        line = f"{who} was canceled" if ctx.outcome == "canceled" else f"{who} is over"
    if approved_by:
        line += f", approved by {approved_by}"
    if e.description and ctx.phase == "scheduled":
        line += f" — {e.description}"
    return line


class _SafeFormatter(string.Formatter):
    """str.format without attribute or index access: `{event_id.__class__}` is refused."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Any:
        if not field_name.isidentifier():
            raise ValueError(f"field {field_name!r}: only plain names are allowed")
        return super().get_field(field_name, args, kwargs)


class WebhookHandler(Handler):
    type_name = "webhook"
    Options = WebhookOptions

    def _url(self) -> str:
        if self.options.url:
            return self.options.url
        assert self.options.url_file is not None
        try:
            url = Path(self.options.url_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"url_file {self.options.url_file} cannot be read: {exc.strerror}") from None
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url_file {self.options.url_file} does not hold an http(s) URL")
        return url

    def _approved_by(self, ctx: Context) -> str | None:
        if ctx.approved_by:
            return ctx.approved_by
        record = self.services.store.result(ctx.event.event_id, "approval")
        return record.get("by") if record and record.get("status") == "sent" else None

    def body(self, ctx: Context) -> tuple[bytes, str]:
        """The request body and its content type, for the preset or template."""
        line = readable(ctx, ctx.clock.now(), self._approved_by(ctx))
        if self.options.template is not None:
            e = ctx.event
            fields = {"event_id": e.event_id, "event_type": e.event_type, "status": e.status, "vm": ctx.vm_name,
                      "resources": ",".join(e.resources), "phase": ctx.phase, "description": e.description,
                      "not_before": e.not_before.isoformat().replace("+00:00", "Z") if e.not_before else "",
                      "source": e.source, "duration_seconds": str(e.duration_seconds), "outcome": ctx.outcome or "",
                      "approved_by": self._approved_by(ctx) or "", "text": line}
            rendered = _SafeFormatter().vformat(self.options.template, (), fields)
            try:
                json.loads(rendered)
                return rendered.encode(), "application/json"
            except ValueError:
                return rendered.encode(), "text/plain; charset=utf-8"
        if self.options.preset == "slack":
            return json.dumps({"text": line}).encode(), "application/json"
        if self.options.preset == "teams":
            card = {"type": "AdaptiveCard", "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
                    "version": "1.4", "body": [{"type": "TextBlock", "text": line, "wrap": True}]}
            return json.dumps({"type": "message", "text": line, "attachments": [
                {"contentType": "application/vnd.microsoft.card.adaptive", "content": card}]}).encode(), \
                "application/json"
        return ctx.payload_json(), "application/json"

    def _post(self, ctx: Context) -> Result:
        log = logs.get("webhook")
        try:
            url = self._url()
        except ValueError as exc:
            return Result(FAILED, str(exc))
        where = "{0.scheme}://{0.hostname}".format(urlsplit(url))
        body, content_type = self.body(ctx)
        headers = {"Content-Type": content_type, "User-Agent": f"maintd/{__version__}", **self.options.headers}
        session = requests.Session()
        deadline = ctx.clock.monotonic() + ctx.timeout
        attempts = 0

        def send() -> requests.Response:
            nonlocal attempts
            attempts += 1
            left = max(0.1, deadline - ctx.clock.monotonic())
            response = session.post(url, data=body, headers=headers, timeout=min(self.options.request_timeout, left))
            if response.status_code == 429 or response.status_code >= 500:
                raise _Retryable(f"{where} answered {response.status_code}")
            return response

        retry = retrying(ctx.clock, retry_if=lambda e: isinstance(e, (_Retryable, requests.ConnectionError,
                                                                          requests.Timeout)),
                         attempts=self.options.retries + 1, within=ctx.timeout, cancel=ctx.cancel)
        try:
            response = retry(send)
        except (_Retryable, requests.RequestException) as exc:
            detail = str(exc) if isinstance(exc, _Retryable) else f"{where}: {type(exc).__name__}"
            log.warning("webhook.failed", handler=self.spec.name, target=where, attempts=attempts, error=detail)
            return Result(FAILED, f"{detail} after {attempts} attempt(s)")
        finally:
            session.close()
        if response.status_code >= 400:
            return Result(FAILED, f"{where} answered {response.status_code}: {response.text[:200]}")
        return Result(OK, f"{where} answered {response.status_code}" + (f" after {attempts} attempts"
                                                                         if attempts > 1 else ""))

    def scheduled(self, ctx: Context) -> Result:
        return self._post(ctx)

    def started(self, ctx: Context) -> Result:
        return self._post(ctx)

    def completed(self, ctx: Context) -> Result:
        return self._post(ctx)
