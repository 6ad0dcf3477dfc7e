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
through the backend's `GateHttp` (`Backend.gate_input`). Whatever goes wrong while reading a gate holds
the approval, is logged and counted (`maintd_gate_check_failures_total`; the log line at most once a minute per gate and
error), and the gate is asked again later.

Pace the remote queries, not the decision (issue 35 #3). Prometheus is queried at most once per
`coordination_rules.gate_recheck_delay` (0.2 queries/s by default): within it the last answer stands.
The fleet gate is checked first (Prometheus is asked only once the fleet allows), and its input
changes are news: a ready peer that says its health changed (`changed`, from its push), this VM's
own health (`local_changed`), or the store's last listing makes `moved` true, and the coordinator
decides again at once instead of waiting for the periodic recheck. A held fleet gate asked again
after such news reads only the VMs that said they changed (one request each); when that opens it,
every VM is read afresh before the approval goes out, as on every first check.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from agent.coordination.backend import FleetStates, GateHttp
from agent.coordination.coordination_rules import (
    UNREACHABLE,
    Held,
    firing,
    fleet_verdict,
    peer_state,
    query_samples,
)
from agent.health.health_json import HealthView
from agent.model.gate_specs import FleetGate, Gates, PrometheusGate
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics


@dataclass(frozen=True)
class Judged:
    """The fleet gate's last check of one event: who asked, how Warning counted, and each VM's state."""

    resources: tuple[str, ...]
    vm_name: str
    warning_as_error: bool
    states: dict[str, str]


class GateChecker:
    """Evaluates the gates of the profile in force for one event, right before the approval would go out."""

    def __init__(self, client: GateHttp, peer_url: Callable[[str], str | None],
                 local_health: Callable[[], HealthView | None], max_concurrency: int, metrics: Metrics,
                 fleet_states: FleetStates | None = None, clock: Callable[[], float] = time.monotonic,
                 pace: Callable[[], float] = lambda: 5.0) -> None:
        """`pace`: the least time between two queries of one Prometheus gate (its last answer stands meanwhile)."""
        self.client = client
        self.clock = clock
        self.pace = pace
        self.throttle = logs.Throttle(clock=clock)
        self.remote = fleet_states is None
        """The fleet gate asks the peers (their /v1/health); else its input is the backend's own (the store's)."""
        self.fleet_states = fleet_states or self._fleet_states
        self.peer_url = peer_url
        self.local_health = local_health
        self.max_concurrency = max_concurrency
        self.metrics = metrics
        self.log = logs.get("gates")
        self._lock = threading.Lock()  # the three tables below: the approver checks, the loop and pushes mark
        self._judged: dict[str, Judged] = {}
        self._stale: dict[str, set[str]] = {}
        """Per event, the VMs whose health may have changed since the last check (their word, or this VM's own)."""
        self._asked: dict[PrometheusGate, tuple[float, Held | None]] = {}

    def check(self, gates: Gates, event_id: str, resources: Sequence[str], vm_name: str,
              warning_as_error: bool) -> Held | None:
        """The first gate that holds the approval (the fleet's, then Prometheus'), or None when every configured gate
        is open."""
        gate = "fleet"
        try:
            if gates.fleet is not None:
                held = self._fleet(gates.fleet, event_id, tuple(resources), vm_name, warning_as_error)
                if held:
                    return held
            gate = "prometheus"
            if gates.prometheus is not None:
                return self._prometheus_paced(gates.prometheus)
        except Exception as exc:  # an answer nobody foresaw: hold, say so, ask again next tick
            self._failed(gate, exc)
            return Held(gate, f"could not evaluate the gate ({type(exc).__name__}); asked again shortly")
        return None

    # --- the fleet gate's input and its changes -------------------------------------------------

    def _fleet(self, gate: FleetGate, event_id: str, resources: tuple[str, ...], vm_name: str,
               warning_as_error: bool) -> Held | None:
        """Held again on the VMs that said they changed, or every VM's state read afresh (and remembered)."""
        with self._lock:
            stale = self._stale.pop(event_id, set())
            judged = self._judged.get(event_id)
        if judged is not None and stale and (judged.resources, judged.vm_name, judged.warning_as_error) == (
                resources, vm_name, warning_as_error):
            fresh = self.fleet_states(event_id, [n for n in resources if n.casefold() in stale], vm_name,
                                      warning_as_error)
            states = {**judged.states, **fresh}
            held = fleet_verdict(states, gate)
            if held is not None:
                self._remember(Judged(resources, vm_name, warning_as_error, states), event_id)
                return held
        states = self.fleet_states(event_id, resources, vm_name, warning_as_error)
        self._remember(Judged(resources, vm_name, warning_as_error, states), event_id)
        return fleet_verdict(states, gate)

    def _remember(self, judged: Judged, event_id: str) -> None:
        with self._lock:
            self._judged[event_id] = judged

    def changed(self, event_id: str, name: str) -> bool:
        """A VM the event names says its health changed (any thread): its state is read again at the next check;
        True when that is news (the event was checked, and the VM not already due to be read)."""
        with self._lock:
            judged = self._judged.get(event_id)
            key = name.casefold()
            if judged is None or key not in {n.casefold() for n in judged.resources} \
                    or key in self._stale.get(event_id, ()):
                return False
            self._stale.setdefault(event_id, set()).add(key)
            return True

    def local_changed(self) -> bool:
        """This VM's own health changed (any thread): read again for every event checked; True when any was."""
        with self._lock:
            for event_id, judged in self._judged.items():
                self._stale.setdefault(event_id, set()).add(judged.vm_name.casefold())
            return bool(self._judged)

    def moved(self, event_id: str) -> bool:
        """Whether the fleet gate's input for the event changed since it was last checked (the loop's thread, after
        the backend published its tick): a VM's word or this VM's own health, or on the store the last listing."""
        with self._lock:
            if self._stale.get(event_id):
                return True
            judged = self._judged.get(event_id)
        if judged is None or self.remote:
            return False
        return self.fleet_states(event_id, judged.resources, judged.vm_name, judged.warning_as_error) != judged.states

    def follow(self, events: Collection[str]) -> None:
        """Forget the events no longer followed (the loop's thread)."""
        with self._lock:
            for event_id in [e for e in self._judged if e not in events]:
                del self._judged[event_id]
            for event_id in [e for e in self._stale if e not in events]:
                del self._stale[event_id]

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

    def _prometheus_paced(self, gate: PrometheusGate) -> Held | None:
        """Prometheus' answer, asked at most once per `pace()` (within it the last answer stands)."""
        now = self.clock()
        with self._lock:
            last = self._asked.get(gate)
        if last is not None and now - last[0] < self.pace():
            return last[1]
        held = self._prometheus(gate)
        with self._lock:
            self._asked[gate] = (now, held)
        return held

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
