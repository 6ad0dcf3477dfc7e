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
  (`/api/v1/query`). A failed query, or an answer of the wrong shape, blocks unless
  `on_failure: ignore`.

The specs and verdicts are pure (`coordination_rules`); this module only gathers the answers
through `peers.PeerClient`. Whatever goes wrong while reading a gate holds the approval, is logged
and counted (`maintd_gate_check_failures_total`; the log line at most once a minute per gate and
error), and the gate is asked again later: a held approval's gates are asked at most once per
`coordination_rules.gate_recheck_delay` (the coordinator paces them).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence

from agent import logs
from agent.coordination.backend import FleetStates
from agent.coordination.coordination_rules import (
    UNREACHABLE,
    Held,
    firing,
    fleet_verdict,
    peer_state,
    query_samples,
)
from agent.coordination.peers.peer_client import PeerClient
from agent.health.health_json import HealthView
from agent.metrics import Metrics
from agent.model.gate_specs import Gates, PrometheusGate


class GateChecker:
    """Evaluates the gates of the profile in force for one event, right before the approval would go out."""

    def __init__(self, client: PeerClient, peer_url: Callable[[str], str | None],
                 local_health: Callable[[], HealthView | None], max_concurrency: int, metrics: Metrics,
                 fleet_states: FleetStates | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.throttle = logs.Throttle(clock=clock)
        self.fleet_states = fleet_states or self._fleet_states
        self.peer_url = peer_url
        self.local_health = local_health
        self.max_concurrency = max_concurrency
        self.metrics = metrics
        self.log = logs.get("gates")

    def check(self, gates: Gates, event_id: str, resources: Sequence[str], vm_name: str,
              warning_as_error: bool) -> Held | None:
        """The first gate that holds the approval, or None when every configured gate is open."""
        gate = "prometheus"
        try:
            if gates.prometheus is not None:
                held = self._prometheus(gates.prometheus)
                if held:
                    return held
            gate = "fleet"
            if gates.fleet is not None:
                states = self.fleet_states(event_id, resources, vm_name, warning_as_error)
                return fleet_verdict(states, gates.fleet)
        except Exception as exc:  # an answer nobody foresaw: hold, say so, ask again next tick
            self._failed(gate, exc)
            return Held(gate, f"could not evaluate the gate ({type(exc).__name__}); asked again shortly")
        return None

    def _failed(self, gate: str, exc: BaseException) -> None:
        self.metrics.gate_check_failures.labels(gate).inc()
        self.throttle.log(self.log.warning, f"{gate}:{type(exc).__name__}", "gate.check_failed", gate=gate,
                          error=f"{type(exc).__name__}: {str(exc)[:200]}")

    def _fleet_states(self, event_id: str, resources: Sequence[str], vm_name: str,
                      warning_as_error: bool) -> dict[str, str]:
        def read(name: str) -> str:
            if name.casefold() == vm_name.casefold():
                return peer_state(self.local_health(), event_id, warning_as_error)
            url = self.peer_url(name)
            if url is None:
                return UNREACHABLE
            try:
                return peer_state(self.client.health(url), event_id, warning_as_error)
            except (OSError, ValueError):  # requests' errors are OSErrors
                return UNREACHABLE

        with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_concurrency,
                                                   thread_name_prefix="gate") as pool:
            return dict(zip(resources, pool.map(read, resources), strict=True))

    def _prometheus(self, gate: PrometheusGate) -> Held | None:
        try:
            if gate.alerts:
                names = firing(self.client.prometheus(gate.url, "/api/v1/alerts", gate.timeout), gate.alerts)
                if names:
                    return Held("prometheus", f"alerts firing: {', '.join(names)}")
            if gate.query:
                samples = query_samples(self.client.prometheus(gate.url, "/api/v1/query", gate.timeout,
                                                               {"query": gate.query}))
                if samples:
                    return Held("prometheus", f"query {gate.query!r} returned {samples} sample(s)")
        except (OSError, ValueError) as exc:
            self._failed("prometheus", exc)
            if gate.on_failure == "block":
                return Held("prometheus", f"query failed ({type(exc).__name__}); on_failure: block")
        return None
