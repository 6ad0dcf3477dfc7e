"""`health`: turn an event's phases into health reports on the Service Fabric model.

Locally (maintd's health store, `/v1/health`): SourceId `maintd`, Property `maintenance/<EventId>`,
Warning while scheduled, `started_state` while started, removed when completed. `started_state`
defaults to Warning: taking the VM out of rotation is the `drain` handler's job (it waits for the
load balancer, follows the profile and survives reboots), and an Error here would also drain the VM
for a few-second Freeze whenever `probe.fail_on` admits the `maintd` SourceId. Pick Error when the
cluster should see the node as unhealthy while the maintenance runs.

Optionally the same report is pushed to a Service Fabric cluster, `POST {cluster_url}/Nodes/{node}/
$/ReportHealth?api-version=6.0&Immediate=true`, with a client certificate. Immediate, because the
HTTP gateway may otherwise hold a report for its send interval (30 s by default: a Preempt's whole
notice). TimeToLive goes out as an ISO 8601 duration, as Service Fabric's own clients write it. A
pushed Warning/Error report with a `ttl` removes itself when it expires: maintd reports on
transitions, not periodically, so an expired report means "maintd went away", not Error. Service
Fabric has no delete for a node report, so `completed` sends an Ok report that removes itself after
`COMPLETED_TTL`. SequenceNumbers are milliseconds since the epoch, so they keep increasing across
restarts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TypedDict
from urllib.parse import quote

from agent.errors import ConfigValueError
from agent.handlers.base import CANCELED, FAILED, OK, Context, Handler, Result
from agent.handlers.webhook import post, target
from agent.health.health_json import HealthInformation
from agent.health.health_store import HealthState
from agent.model.config_schema import boolean, choice, duration, opt, optional, text
from agent.model.events import maintenance_property
from agent.net import boundedhttp

SOURCE_ID = "maintd"
REPORT_QUERY = "api-version=6.0&Immediate=true"
COMPLETED_TTL = 60.0
PUSH_ATTEMPTS = 3
PUSH_TIMEOUT = 10.0
"""Seconds one push request may take (capped by what is left of the run's budget)."""


@dataclass(frozen=True)
class HealthOptions:
    started_state: str = opt(choice("Warning", "Error"), "Warning",
                             "state while the event is Started (Error also takes the VM out of rotation, "
                             "unless probe.fail_on excludes maintd)")
    cluster_url: str | None = opt(optional(text(r"^https?://\S+$", "a URL such as https://sf.example:19080")), None,
                                  "Service Fabric cluster endpoint to push the reports to (none: local only)")
    node_name: str | None = opt(optional(text()), None, "Service Fabric node name (default: this VM's name)")
    ttl: float | None = opt(optional(duration(1, 30 * 86400)), None,
                            "TimeToLive of pushed Warning/Error reports (none: until replaced)")
    client_cert: str | None = opt(optional(text(r"^/", "an absolute path")), None, "client certificate (PEM)")
    client_key: str | None = opt(optional(text(r"^/", "an absolute path")), None, "its private key (PEM)")
    ca_cert: str | None = opt(optional(text(r"^/", "an absolute path")), None, "CA bundle to verify the cluster")
    verify: bool = opt(boolean, True, "verify the cluster's certificate (false only for tests)")

    def validate(self) -> None:
        if self.client_key and not self.client_cert:
            raise ConfigValueError("client_key", "client_key needs client_cert")
        if self.ca_cert and not self.verify:
            raise ConfigValueError("verify", "verify: false contradicts ca_cert; set one of them")


def iso_duration(seconds: float) -> str:
    """An ISO 8601 duration as .NET's XmlConvert writes a TimeSpan: 1800 s is PT30M, 90061 s is P1DT1H1M1S."""
    ms = round(seconds * 1000)
    days, ms = divmod(ms, 86_400_000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms // 1000}.{ms % 1000:03d}".rstrip("0").rstrip(".") if ms else ""
    clock = "".join(f"{n}{unit}" for n, unit in ((hours, "H"), (minutes, "M")) if n) + (f"{secs}S" if secs else "")
    out = "P" + (f"{days}D" if days else "") + (f"T{clock}" if clock else "")
    return out if out != "P" else "PT0S"


class _Tls(TypedDict):
    """The TLS arguments of a request to the cluster."""

    cert: str | tuple[str, str] | None
    verify: bool | str


def health_information(prop: str, state: str, description: str, ttl: float | None, remove: bool,
                       sequence: int) -> HealthInformation:
    """The Service Fabric `HealthInformation` body (SequenceNumber as text, like SF's int64)."""
    body: HealthInformation = {"SourceId": SOURCE_ID, "Property": prop, "HealthState": state,
                               "Description": description, "SequenceNumber": str(sequence), "RemoveWhenExpired": remove}
    if ttl is not None:
        body["TimeToLiveInMilliSeconds"] = iso_duration(ttl)
    return body


class HealthHandler(Handler):
    type_name = "health"
    Options = HealthOptions

    _sequence_lock = threading.Lock()
    _last_sequence = 0

    def _sequence(self, ctx: Context) -> int:
        """Milliseconds since the epoch, and always above the last one this process sent."""
        with HealthHandler._sequence_lock:
            value = max(int(ctx.clock.now().timestamp() * 1000), HealthHandler._last_sequence + 1)
            HealthHandler._last_sequence = value
            return value

    def _describe(self, ctx: Context) -> str:
        e = ctx.event
        when = f", not before {e.not_before:%Y-%m-%d %H:%M} UTC" if e.not_before else ""
        return f"{e.event_type} {e.event_id} {e.status.lower()}{when}" + (f": {e.description}" if e.description else "")

    def _prop(self, ctx: Context) -> str:
        return maintenance_property(ctx.event.event_id)

    def _push(self, ctx: Context, state: str, description: str, ttl: float | None) -> str | None:
        """Send the report to the cluster; an error text, or None when it was accepted (or there is no cluster)."""
        o = self.options
        if not o.cluster_url:
            return None
        node = o.node_name or ctx.vm_name
        url = f"{o.cluster_url.rstrip('/')}/Nodes/{quote(node, safe='')}/$/ReportHealth?{REPORT_QUERY}"
        body = health_information(self._prop(ctx), state, description, ttl, ttl is not None, self._sequence(ctx))
        tls: _Tls = {  # per request: a Session's verify loses to $REQUESTS_CA_BUNDLE
            "cert": (o.client_cert, o.client_key) if o.client_key else o.client_cert, "verify": o.ca_cert or o.verify}
        with boundedhttp.session() as session:
            try:
                answer = post(ctx, session, url, attempts=PUSH_ATTEMPTS, request_timeout=PUSH_TIMEOUT, json=body, **tls)
            except OSError as exc:  # a certificate or CA file that cannot be read
                return f"Service Fabric push to {target(url)} failed: {exc}"[:300]
        r = answer.response
        if r is None:
            return f"Service Fabric push to {target(url)} failed after {answer.tries} attempt(s): {answer.error}"
        if r.status >= 400:
            return f"Service Fabric {target(url)} answered {r.status}: {r.text[:200]}"
        return None

    def _report(self, ctx: Context, state: HealthState) -> Result:
        description = self._describe(ctx)
        self.services.health.set(SOURCE_ID, self._prop(ctx), state, description)
        if ctx.event_gone:  # `completed` may already have cleared the report: leave none behind, push none
            self.services.health.remove(SOURCE_ID, self._prop(ctx))
            return Result(CANCELED, "the event left the document; no report left behind")
        error = self._push(ctx, state.label, description, self.options.ttl)
        return Result(FAILED, error) if error else Result(OK, f"{state.label} reported")

    def scheduled(self, ctx: Context) -> Result:
        return self._report(ctx, HealthState.WARNING)

    def started(self, ctx: Context) -> Result:
        return self._report(ctx, HealthState.parse(self.options.started_state))

    def completed(self, ctx: Context) -> Result:
        self.services.health.remove(SOURCE_ID, self._prop(ctx))
        e = ctx.event
        error = self._push(ctx, HealthState.OK.label, f"{e.event_type} {e.event_id} {ctx.outcome or 'completed'}",
                           COMPLETED_TTL)
        return Result(FAILED, error) if error else Result(OK, "report removed")
