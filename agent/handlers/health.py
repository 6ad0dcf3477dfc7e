"""`health`: turn an event's phases into health reports on the Service Fabric model.

Locally (maintd's health store, `/v1/health`): SourceId `maintd`, Property `maintenance/<EventId>`,
Warning while scheduled, `started_state` (Warning by default, Error if configured) while started,
removed when completed. Optionally the same report is pushed to a Service Fabric cluster
(`POST {cluster_url}/Nodes/{node}/$/ReportHealth?api-version=6.0`), with a client certificate;
Service Fabric has no delete for a node report, so `completed` sends an Ok report that removes itself
when its short TimeToLive expires. SequenceNumbers are milliseconds since the epoch, so they keep
increasing across restarts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests

from agent.configschema import boolean, choice, duration, opt, optional, text
from agent.errors import ConfigValueError
from agent.handlers.base import FAILED, OK, Context, Handler, Result
from agent.health import HealthState
from agent.retry import retrying

SOURCE_ID = "maintd"
COMPLETED_TTL = 60.0


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


def health_information(prop: str, state: str, description: str, ttl: float | None, remove: bool,
                       sequence: int) -> dict[str, Any]:
    """The Service Fabric `HealthInformation` body."""
    body: dict[str, Any] = {"SourceId": SOURCE_ID, "Property": prop, "HealthState": state, "Description": description,
                            "SequenceNumber": str(sequence), "RemoveWhenExpired": remove}
    if ttl is not None:
        body["TimeToLiveInMilliSeconds"] = str(int(ttl * 1000))
    return body


class HealthHandler(Handler):
    type_name = "health"
    Options = HealthOptions
    idempotent = True

    _sequence_lock = threading.Lock()
    _last_sequence = 0

    def _sequence(self, ctx: Context) -> int:
        with HealthHandler._sequence_lock:
            value = max(int(ctx.clock.now().timestamp() * 1000), HealthHandler._last_sequence + 1)
            HealthHandler._last_sequence = value
            return value

    def _describe(self, ctx: Context) -> str:
        e = ctx.event
        when = f", not before {e.not_before:%Y-%m-%d %H:%M} UTC" if e.not_before else ""
        return f"{e.event_type} {e.event_id} {e.status.lower()}{when}" + (f": {e.description}" if e.description else "")

    def _push(self, ctx: Context, state: str, description: str, ttl: float | None, remove: bool) -> str | None:
        """Send the report to the cluster; an error text, or None when it was accepted (or there is no cluster)."""
        o = self.options
        if not o.cluster_url:
            return None
        node = o.node_name or ctx.vm_name
        url = f"{o.cluster_url.rstrip('/')}/Nodes/{quote(node, safe='')}/$/ReportHealth?api-version=6.0"
        body = health_information(f"maintenance/{ctx.event.event_id}", state, description, ttl, remove,
                                  self._sequence(ctx))
        cert: Any = (o.client_cert, o.client_key) if o.client_key else o.client_cert
        verify: Any = o.ca_cert or o.verify

        def post() -> requests.Response:
            r = requests.post(url, json=body, cert=cert, verify=verify, timeout=min(10.0, max(0.5, ctx.timeout)))
            if r.status_code >= 500:
                raise requests.ConnectionError(f"answered {r.status_code}")
            return r

        try:
            response = retrying(ctx.clock, retry_if=lambda e: isinstance(e, requests.RequestException), attempts=3,
                                within=ctx.timeout, cancel=ctx.cancel)(post)
        except requests.RequestException as exc:
            return f"Service Fabric push failed: {type(exc).__name__}: {exc}"[:300]
        if response.status_code >= 400:
            return f"Service Fabric answered {response.status_code}: {response.text[:200]}"
        return None

    def _report(self, ctx: Context, state: HealthState) -> Result:
        description = self._describe(ctx)
        self.services.health.set(SOURCE_ID, f"maintenance/{ctx.event.event_id}", state, description)
        error = self._push(ctx, state.label, description, self.options.ttl, False)
        return Result(FAILED, error) if error else Result(OK, f"{state.label} reported")

    def scheduled(self, ctx: Context) -> Result:
        return self._report(ctx, HealthState.WARNING)

    def started(self, ctx: Context) -> Result:
        return self._report(ctx, HealthState.parse(self.options.started_state))

    def completed(self, ctx: Context) -> Result:
        self.services.health.remove(SOURCE_ID, f"maintenance/{ctx.event.event_id}")
        error = self._push(ctx, "Ok", f"{ctx.event.event_type} {ctx.event.event_id} {ctx.outcome or 'completed'}",
                           COMPLETED_TTL, True)
        return Result(FAILED, error) if error else Result(OK, "report removed")
