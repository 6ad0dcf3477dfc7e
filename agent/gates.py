"""Approval gates: hold an approval the leader would send while the fleet cannot afford it.

Two gates, both off unless configured (`gates:` at the top level, or per profile):

- **fleet** — Service Fabric cluster health policy semantics: the share of VMs in the event's
  Resources whose aggregated health is Error (Warning too with `health.consider_warning_as_error`)
  may not exceed `max_percent_unhealthy`, rounded up so one failure is tolerated in small fleets.
  Each peer's health is read from its `/v1/health`; reports about the event itself (maintd's own
  `maintenance/<EventId>` report and pending-maintenance note) do not count, so a VM that is only
  draining for the event is healthy. Unreachable peers count as Error unless
  `unreachable_counts_as: ignore`.
- **prometheus** — as kured does for reboots: block while any alert named in `alerts` (names or
  regular expressions) is firing (`/api/v1/alerts`), or while `query` returns samples
  (`/api/v1/query`). A failed query blocks unless `on_failure: ignore`.

Holding costs little: the event still starts at NotBefore. The pure parts (`allowed_unhealthy`,
`fleet_verdict`, `peer_state`, `firing`) take no I/O; `GateChecker` does the HTTP.
"""

from __future__ import annotations

import concurrent.futures
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import requests

from agent.configschema import choice, duration, integer, list_of, opt, optional, section, text
from agent.errors import ConfigValueError

OK, UNHEALTHY, UNREACHABLE = "ok", "unhealthy", "unreachable"


def _regex(value: Any) -> str:
    pattern = text()(value)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ConfigValueError("", f"{pattern!r} is not a regular expression: {exc}") from None
    return pattern


@dataclass(frozen=True)
class FleetGate:
    max_percent_unhealthy: int = opt(integer(0, 100), doc="share (%) of the event's VMs that may be unhealthy; rounds up")
    unreachable_counts_as: str = opt(choice("error", "ignore"), "error",
                                     "error: an unreachable peer counts as unhealthy; ignore: it is left out")


@dataclass(frozen=True)
class PrometheusGate:
    url: str = opt(text(r"^https?://\S+$", "a base URL such as http://prometheus:9090"), doc="Prometheus base URL")
    alerts: tuple[str, ...] = opt(list_of(_regex, unique=True), (),
                                  "block while an alert whose name matches one of these (names or regexes) fires")
    query: str | None = opt(optional(text()), None, "PromQL; block while it returns any sample")
    timeout: float = opt(duration(0.1, 60), 5.0, "timeout of one query")
    on_failure: str = opt(choice("block", "ignore"), "block", "what a failed query means: block, or ignore the gate")

    def validate(self) -> None:
        if not self.alerts and not self.query:
            raise ConfigValueError("alerts", "set alerts (alert names or regexes), query (PromQL), or both")


@dataclass(frozen=True)
class Gates:
    fleet: FleetGate | None = opt(optional(section(FleetGate)), None, "fleet health gate (off when unset)")
    prometheus: PrometheusGate | None = opt(optional(section(PrometheusGate)), None,
                                            "Prometheus alert gate (off when unset)")

    @property
    def active(self) -> bool:
        return self.fleet is not None or self.prometheus is not None


NO_GATES = Gates()


@dataclass(frozen=True)
class Held:
    """Why an approval is held: the gate and a readable reason."""

    gate: str
    reason: str


# --- pure rules ------------------------------------------------------------------------------

def allowed_unhealthy(total: int, max_percent: int) -> int:
    """How many of `total` VMs may be unhealthy: ceil(total × max_percent / 100), as Service Fabric rounds."""
    return math.ceil(total * max_percent / 100)


def fleet_verdict(states: dict[str, str], gate: FleetGate) -> Held | None:
    """Hold when more VMs are unhealthy than the policy tolerates; `states` maps VM name to ok/unhealthy/unreachable."""
    counted = {n: s for n, s in states.items() if not (s == UNREACHABLE and gate.unreachable_counts_as == "ignore")}
    bad = sorted(n for n, s in counted.items() if s != OK)
    allowed = allowed_unhealthy(len(counted), gate.max_percent_unhealthy)
    if len(bad) <= allowed:
        return None
    shown = ", ".join(f"{n} ({states[n]})" for n in bad[:5]) + (f" +{len(bad) - 5} more" if len(bad) > 5 else "")
    return Held("fleet", f"{len(bad)} of {len(counted)} VMs unhealthy, {gate.max_percent_unhealthy}% allows "
                         f"{allowed}: {shown}")


def peer_state(health: Any, event_id: str, warning_as_error: bool) -> str:
    """ok or unhealthy from a `/v1/health` body, leaving out the reports about the event itself."""
    if not isinstance(health, dict) or not isinstance(health.get("HealthEvents"), list):
        return UNREACHABLE
    bad = {"Error"} | ({"Warning"} if warning_as_error else set())
    for report in health["HealthEvents"]:
        if not isinstance(report, dict):
            continue
        about_event = (report.get("SourceId") == "maintd" and report.get("Property") == f"maintenance/{event_id}") \
            or report.get("SourceId") == "maintenance"
        state = "Error" if report.get("IsExpired") else report.get("HealthState")
        if not about_event and state in bad:
            return UNHEALTHY
    return OK


def firing(alerts_body: Any, patterns: Sequence[str]) -> list[str]:
    """Names of firing alerts (from /api/v1/alerts) that match one of `patterns` in full."""
    compiled = [re.compile(p) for p in patterns]
    alerts = alerts_body.get("data", {}).get("alerts", []) if isinstance(alerts_body, dict) else []
    names = {a.get("labels", {}).get("alertname", "") for a in alerts
             if isinstance(a, dict) and a.get("state") == "firing"}
    return sorted(n for n in names if any(c.fullmatch(n) for c in compiled))


# --- I/O -------------------------------------------------------------------------------------

class GateChecker:
    """Evaluates the gates of the profile in force for one event, right before the approval would go out."""

    def __init__(self, session: requests.Session, peer_url: Callable[[str], str],
                 token_reader: Callable[[], str | None], local_health: Callable[[], dict[str, Any]],
                 request_timeout: float, max_concurrency: int) -> None:
        self.session = session
        self.peer_url = peer_url
        self.token_reader = token_reader
        self.local_health = local_health
        self.request_timeout = request_timeout
        self.max_concurrency = max_concurrency

    def check(self, gates: Gates, event_id: str, resources: Sequence[str], vm_name: str,
              warning_as_error: bool) -> Held | None:
        """The first gate that holds the approval, or None when every configured gate is open."""
        if gates.prometheus is not None:
            held = self._prometheus(gates.prometheus)
            if held:
                return held
        if gates.fleet is not None:
            states = self._fleet_states(event_id, resources, vm_name, warning_as_error)
            return fleet_verdict(states, gates.fleet)
        return None

    def _fleet_states(self, event_id: str, resources: Sequence[str], vm_name: str,
                      warning_as_error: bool) -> dict[str, str]:
        token = self.token_reader()
        headers = {"Authorization": f"Bearer {token}"} if token else {}

        def read(name: str) -> str:
            if name.casefold() == vm_name.casefold():
                return peer_state(self.local_health(), event_id, warning_as_error)
            try:
                r = self.session.get(f"{self.peer_url(name)}/v1/health", headers=headers, timeout=self.request_timeout)
                return peer_state(r.json(), event_id, warning_as_error) if r.status_code == 200 else UNREACHABLE
            except (requests.RequestException, ValueError):
                return UNREACHABLE

        with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_concurrency,
                                                   thread_name_prefix="gate") as pool:
            return dict(zip(resources, pool.map(read, resources)))

    def _prometheus(self, gate: PrometheusGate) -> Held | None:
        base = gate.url.rstrip("/")
        try:
            if gate.alerts:
                r = self.session.get(f"{base}/api/v1/alerts", timeout=gate.timeout)
                r.raise_for_status()
                names = firing(r.json(), gate.alerts)
                if names:
                    return Held("prometheus", f"alerts firing: {', '.join(names)}")
            if gate.query:
                r = self.session.get(f"{base}/api/v1/query", params={"query": gate.query}, timeout=gate.timeout)
                r.raise_for_status()
                result = r.json().get("data", {}).get("result", [])
                if result:
                    return Held("prometheus", f"query {gate.query!r} returned {len(result)} sample(s)")
        except (requests.RequestException, ValueError, AttributeError) as exc:
            if gate.on_failure == "block":
                return Held("prometheus", f"query failed ({type(exc).__name__}); on_failure: block")
        return None
