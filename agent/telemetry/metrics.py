"""Every Prometheus metric maintd exposes, defined once, on an injected registry.

Label values are bounded: EventIds never become labels; event types are the five known ones or
`Other`; handler names come from the config. Labelled series with known values are initialised
at start so dashboards and alerts see zeros rather than gaps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from agent import __version__, deferred

# The package's __init__ imports its HTTP servers, clients and ssl (about 7 MB resident) for the exposition,
# which `render` does itself: only the metric types and the registry are loaded (decision 0220).
deferred.defer("prometheus_client")
from prometheus_client.metrics import Counter, Gauge, Histogram  # noqa: E402
from prometheus_client.registry import CollectorRegistry  # noqa: E402

from agent.model.approval import APPROVAL_OUTCOMES  # noqa: E402
from agent.model.events import KNOWN_TYPES  # noqa: E402
from agent.model.outcomes import OUTCOMES  # noqa: E402
from agent.telemetry.metrics_text import exposition  # noqa: E402

EVENT_TYPES = (*KNOWN_TYPES, "Other")
IMDS_ENDPOINTS = ("scheduledevents", "compute", "approve", "identity")
STORE_OPS = ("put", "list", "create", "replace", "read")
"""Requests to the coordination store (backend azure_blob): see agent.coordination.store.blob_store."""
PEER_OUTCOMES = ("ready", "not_ready", "unreachable", "invalid", "pushed", "push_failed")
GATE_NAMES = ("fleet", "prometheus")


class Metrics:
    """The daemon's metrics; one instance per registry (tests make their own)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._swap_lock = threading.Lock()
        self._shown: dict[Gauge, set[tuple[str, ...]]] = {}
        r = self.registry
        self.build_info = Gauge("maintd_build_info", "maintd version, always 1", ["version"], registry=r)
        self.build_info.labels(__version__).set(1)
        self.imds_requests = Counter("maintd_imds_requests_total",
                                     "IMDS requests by endpoint and HTTP status "
                                     "(error = timeout or connection failure)",
                                     ["endpoint", "code"], registry=r)
        self.imds_duration = Histogram("maintd_imds_request_duration_seconds", "IMDS request duration", ["endpoint"],
                                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
                                       registry=r)
        self.poll_last_success = Gauge("maintd_poll_last_success_timestamp_seconds",
                                       "Unix time of the last successful Scheduled Events poll", registry=r)
        self.poll_failures = Gauge("maintd_poll_consecutive_failures", "Failed polls since the last success",
                                   registry=r)
        self.document_incarnation = Gauge("maintd_document_incarnation", "DocumentIncarnation of the last document",
                                          registry=r)
        self.events = Gauge("maintd_events", "Events in the current document",
                            ["event_type", "status", "scope"], registry=r)
        self.next_maintenance = Gauge("maintd_next_maintenance_timestamp_seconds",
                                      "Earliest NotBefore (Unix time) of the Scheduled events naming this VM, by type",
                                      ["event_type"], registry=r)
        self.event_prepare = Gauge("maintd_event_prepare_timestamp_seconds",
                                   "Earliest planned preparation time (Unix time) of the events naming this VM whose "
                                   "preparation waits for its lead time or window, by type", ["event_type"], registry=r)
        self.event_notice = Histogram("maintd_event_notice_seconds",
                                      "NotBefore minus the time maintd first saw the event", ["event_type"],
                                      buckets=(0, 30, 60, 120, 300, 600, 900, 1800, 3600, 86400, 604800),
                                      registry=r)
        self.events_malformed = Counter("maintd_events_malformed_total",
                                        "Events skipped because a required field was missing or malformed "
                                        "(once per document that carries them)",
                                        registry=r)
        self.documents_malformed = Counter("maintd_documents_malformed_total",
                                           "Documents refused as a whole (not JSON, no Events list)", registry=r)
        self.transitions = Counter("maintd_event_transitions_total", "Event transitions seen",
                                   ["kind", "event_type"], registry=r)
        self.in_rotation = Gauge("maintd_in_rotation", "1 while the probe answers 200, 0 while out of rotation",
                                 registry=r)
        self.health_state = Gauge("maintd_health_state", "Aggregated health: 0 Ok, 1 Warning, 2 Error", registry=r)
        self.handler_runs = Counter("maintd_handler_runs_total",
                                    "Handler runs by outcome (canceled: cut short because its event left the document)",
                                    ["handler", "phase", "outcome"], registry=r)
        self.handler_duration = Histogram("maintd_handler_duration_seconds", "Handler run duration",
                                          ["handler", "phase"],
                                          buckets=(0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 900), registry=r)
        self.deadline_short = Counter("maintd_deadline_short_total",
                                      "Handler timeouts or drain waits cut short by an event's NotBefore", registry=r)
        self.leader = Gauge("maintd_leader", "Events of this type for which this VM is the approving leader",
                            ["event_type"], registry=r)
        self.approvals = Counter("maintd_approvals_total", "Approval (StartRequests) attempts by outcome",
                                 ["outcome"], registry=r)
        self.peer_requests = Counter("maintd_peer_requests_total",
                                     "Requests to peers by outcome: readiness asks (ready, not_ready, unreachable, "
                                     "invalid) and readiness pushes to the leader (pushed, push_failed)",
                                     ["outcome"], registry=r)
        self.store_requests = Counter("maintd_store_requests_total",
                                      "Requests to the coordination store (backend azure_blob) by operation and "
                                      "outcome (ok; conflict, absent and not_modified are expected answers; the rest "
                                      "failures)",
                                      ["op", "outcome"], registry=r)
        self.budget_members = Gauge("maintd_budget_members",
                                    "Members of this VM's disruption budget group as the store last said: out (a "
                                    "place by choice), forced (out over budget), waiting", ["state"], registry=r)
        self.budget_wait = Histogram("maintd_budget_wait_seconds",
                                     "How long this VM waited for a place in its disruption budget (until it took one "
                                     "or was forced)", buckets=(0, 1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600),
                                     registry=r)
        self.budget_lost = Counter("maintd_budget_lost_total",
                                   "Places in the disruption budget this VM lost (B2): its lease ended without a "
                                   "renewal (lease_ended), or the record no longer listed it (dropped); it returned "
                                   "to rotation and queued again", ["reason"], registry=r)
        self.budget_wake = Counter("maintd_budget_wake_hints_total",
                                   "Wake hints of the disruption budget: sent to a member a release handed a place, "
                                   "failed to send (the member reads on its fallback poll), received", ["outcome"],
                                   registry=r)
        self.budget_record_problems = Counter("maintd_budget_record_problems_total",
                                              "Odd records found in the disruption budget's places record, each "
                                              "counted once: an instant past the store's clock (future_instant, "
                                              "ignored), a record that is not a places record (unreadable)",
                                              ["problem"], registry=r)
        self.lane_errors = Counter("maintd_lane_errors_total",
                                   "Jobs on a worker lane that raised instead of handling their own failure, by lane "
                                   "(store, peer, history); each is logged as lane.internal_error and its work put "
                                   "back to be retried", ["lane"], registry=r)
        self.profile_active = Gauge("maintd_profile_active", "1 for the profile in force", ["profile"], registry=r)
        self.gate_blocked = Gauge("maintd_approval_gate_blocked", "1 while an approval gate holds an approval",
                                  ["gate"], registry=r)
        self.gate_check_failures = Counter("maintd_gate_check_failures_total",
                                           "Gate checks that failed or got an answer of the wrong shape", ["gate"],
                                           registry=r)
        self.state_write_failures = Counter("maintd_state_write_failures_total",
                                            "Failed writes of the state file (full or read-only disk)", registry=r)
        self.state_load_failures = Counter("maintd_state_load_failures_total",
                                           "State files found unusable at start (moved aside, maintd started fresh)",
                                           registry=r)
        self.state_dirty = Gauge("maintd_state_unsaved", "1 while some state change has not reached the disk",
                                 registry=r)
        self.config_reloads = Counter("maintd_config_reloads_total", "Config reloads (SIGHUP) by outcome",
                                      ["outcome"], registry=r)
        self.loop_last_tick = Gauge("maintd_loop_last_tick_timestamp_seconds", "Unix time of the loop's last tick",
                                    registry=r)
        self.rule_sample_failures = Counter("maintd_rule_sample_failures_total",
                                            "Health rule samples that failed", registry=r)
        self.http_requests = Counter("maintd_http_requests_total", "Requests to maintd's HTTP server",
                                     ["route", "code"], registry=r)
        self.http_dropped = Counter("maintd_http_connections_dropped_total",
                                    "Connections the HTTP server closed to stay available (per_client: over "
                                    "server.max_connections_per_client; evicted: room made when full; memory: the "
                                    "largest input buffer when all connections' buffers together reached their budget; "
                                    "request_timeout: no whole request within server.read_timeout; "
                                    "internal_error: a bug while serving it, answered 500 and logged as "
                                    "http.internal_error)",
                                    ["reason"], registry=r)
        self.silences = Gauge("maintd_silences",
                              "Alertmanager silences an alertmanager handler keeps now (one per event and replica, "
                              "pending or active)", ["handler"], registry=r)
        self.silence_failures = Counter("maintd_silence_failures_total",
                                        "Requests to make, extend or expire an Alertmanager silence that failed "
                                        "(after retries, per replica)", ["handler"], registry=r)
        self._pacemaker(r)
        self._initialise()

    def _pacemaker(self, r: CollectorRegistry) -> None:
        """The `pacemaker` handler's family: this node's state in its cluster and what the handler did."""
        h = ["handler"]
        self.pacemaker_online = Gauge("maintd_pacemaker_node_online", "1 while this node is online in its "
                                      "Pacemaker cluster (as crm_mon says)", h, registry=r)
        self.pacemaker_standby = Gauge("maintd_pacemaker_node_standby", "1 while this node is in standby", h,
                                       registry=r)
        self.pacemaker_resources = Gauge("maintd_pacemaker_resources_active", "Cluster resources active on this "
                                         "node", h, registry=r)
        self.pacemaker_nodes_online = Gauge("maintd_pacemaker_nodes_online", "Cluster nodes online and not in "
                                            "standby, this one included", h, registry=r)
        self.pacemaker_standby_total = Counter("maintd_pacemaker_standby_total", "Times the handler put this node "
                                               "in standby for an event", h, registry=r)
        self.pacemaker_holds = Counter("maintd_pacemaker_holds_total", "Holds: the node stayed in (no standby) "
                                       "because taking it out would break min_online (each new reason counted)",
                                       h, registry=r)
        self.pacemaker_move_seconds = Histogram("maintd_pacemaker_move_seconds", "From standby until no resource "
                                                "is active on this node", h, registry=r,
                                                buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 600))
        self.pacemaker_errors = Counter("maintd_pacemaker_errors_total", "Events the handler could not prepare the "
                                        "cluster for, by reason (whole_cluster, cannot_leave, held, command_failed)",
                                        ["handler", "reason"], registry=r)
        self.pacemaker_command_failures = Counter("maintd_pacemaker_command_failures_total", "Cluster commands "
                                                  "(crm_mon, cibadmin, crm_attribute, crm_node) that failed",
                                                  ["handler", "command"], registry=r)

    def init_pacemaker(self, name: str) -> None:
        """A pacemaker handler's series, at zero before its first look at the cluster."""
        for gauge in (self.pacemaker_online, self.pacemaker_standby, self.pacemaker_resources,
                      self.pacemaker_nodes_online):
            gauge.labels(name)
        self.pacemaker_standby_total.labels(name)
        self.pacemaker_holds.labels(name)
        self.pacemaker_move_seconds.labels(name)
        for reason in ("whole_cluster", "cannot_leave", "held", "command_failed"):
            self.pacemaker_errors.labels(name, reason)
        for command in ("crm_mon", "cibadmin", "crm_attribute", "crm_node"):
            self.pacemaker_command_failures.labels(name, command)

    def _initialise(self) -> None:
        for endpoint in IMDS_ENDPOINTS:
            self.imds_requests.labels(endpoint, "200")
        for approval in APPROVAL_OUTCOMES:
            self.approvals.labels(approval)
        for outcome in PEER_OUTCOMES:
            self.peer_requests.labels(outcome)
        for gate in GATE_NAMES:
            self.gate_check_failures.labels(gate)
        for event_type in EVENT_TYPES:
            self.leader.labels(event_type).set(0)
            self.event_notice.labels(event_type)  # a rate() needs the zero before the first observation
        for outcome in ("ok", "failed"):
            self.config_reloads.labels(outcome)
        for reason in ("per_client", "evicted", "memory", "request_timeout", "internal_error"):
            self.http_dropped.labels(reason)
        for reason in ("lease_ended", "dropped"):
            self.budget_lost.labels(reason)
        for problem in ("future_instant", "unreadable"):  # budget_records.PROBLEMS (the base imports no wing)
            self.budget_record_problems.labels(problem)
        self.in_rotation.set(1)

    def follow_verdict(self, in_rotation: Callable[[], bool], health_state: Callable[[], int]) -> None:
        """Compute `maintd_in_rotation` and `maintd_health_state` when scraped, from what `/probe` reads,
        so a scrape never disagrees with the probe."""
        self.in_rotation.set_function(lambda: 1.0 if in_rotation() else 0.0)
        self.health_state.set_function(lambda: float(health_state()))

    def init_handler(self, name: str, phases: tuple[str, ...]) -> None:
        """Create a configured handler's series (runs and durations) so they read 0 before its first run."""
        for phase in phases:
            self.handler_duration.labels(name, phase)  # else the first run's rate() is NaN: "No data"
            for outcome in OUTCOMES:
                self.handler_runs.labels(name, phase, outcome)

    def swap(self, gauge: Gauge, values: Mapping[tuple[str, ...], float]) -> None:
        """Make a labelled gauge's series exactly `values`: every value is set first, then the series no longer
        in `values` are removed, so a scrape in between never misses a series that exists before and after
        (a gauge is never cleared and refilled)."""
        with self._swap_lock:
            for labels, value in values.items():
                gauge.labels(*labels).set(value)
            for labels in self._shown.get(gauge, set()) - values.keys():
                gauge.remove(*labels)
            self._shown[gauge] = set(values)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return exposition(self.registry.collect())
