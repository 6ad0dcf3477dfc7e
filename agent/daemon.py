"""Wiring and the loop: builds the parts from the config, polls on monotonic deadlines, acts on signals.

The loop polls once per `imds.poll_interval` (deadline += interval, so 3600 polls take 3600 s
± one interval) and never waits on a handler, a peer or the disk: handlers and peer requests run on
worker threads and report back through the state store. The IMDS request itself runs on a
worker too, so the loop keeps pinging the systemd watchdog during IMDS's slow first answer and a
SIGTERM is acted on at once. Signal handlers only set flags; the loop acts on them next tick.
"""

from __future__ import annotations

import concurrent.futures
import signal
import threading
from dataclasses import replace
from pathlib import Path
from datetime import datetime
from typing import Any, Callable, Iterable

import requests

from agent import config as config_mod
from agent import logs
from agent.clock import Clock
from agent.config import Config
from agent.errors import ConfigError, ImdsError, ImdsRequestRejected, StateError
from agent.events import Document
from agent.coordinator import Coordinator
from agent.handlers.base import Services
from agent.handlers.registry import instantiate
from agent.health import HealthState, HealthStore
from agent.imds import ImdsClient, PollResult, is_transient, next_poll_delay
from agent.metrics import Metrics
from agent.policy import Profile, in_force
from agent.retry import retrying as retrying_on
from agent.rotation import Rotation
from agent.rules import RuleEngine
from agent.runner import Runner
from agent.server import ApiServer
from agent.state import Store
from agent.systemd import Notifier, system_is_stopping
from agent.tcpprobe import TcpProbe
from agent.tracker import Tracked, Transition, diff

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
STOP_DRAIN = "stop"
HANDLER_STOP_GRACE = 10.0
"""Seconds running handlers get to finish when maintd stops, before they are cut short."""
PRUNE_EVERY = 60.0
"""Longest gap between two checks for finished events past `state.retention`."""


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    """The kernel's boot id (changes on every boot), or "" where there is none."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def next_maintenance(tracked: Iterable[Tracked]) -> dict[str, datetime]:
    """Earliest NotBefore per event type among the Scheduled events naming this VM."""
    out: dict[str, datetime] = {}
    for t in tracked:
        nb = t.event.not_before
        if t.names_self and t.event.status == "Scheduled" and nb is not None:
            label = t.event.type_label
            out[label] = min(out.get(label, nb), nb)
    return out


def read_secret(path: str | None) -> str | None:
    """The stripped contents of a secret file (token, URL), or None when unset or unreadable."""
    if not path:
        return None
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return value or None


class Daemon:
    """One maintd instance. `start()`, then `tick()` repeatedly (or `run()`), then `shutdown()`."""

    def __init__(self, config: Config, *, clock: Clock, metrics: Metrics | None = None,
                 session: requests.Session | None = None, boot_id: str | None = None,
                 notifier: Notifier | None = None, config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.notifier = notifier or Notifier()
        self.log = logs.get("daemon")
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        self.health = HealthStore(clock)
        self.store = Store(config.state.dir, clock, retention=config.state.retention,
                           journal_max_bytes=config.state.journal_max_bytes, journal_keep=config.state.journal_keep)
        self.rotation = Rotation(self.store, self.health, config.probe.fail_on,
                                 config.health.consider_warning_as_error)
        self._session = session
        self.server: ApiServer | None = None
        self.tcp_probe: TcpProbe | None = None
        self.imds = self._make_client(config)
        self.vm_name: str | None = None if config.identity.name == "auto" else config.identity.name
        self.tracked: dict[str, Tracked] = {}
        self.document: Document | None = None
        self.failures = 0
        self.next_poll = clock.monotonic()
        self.last_success: float | None = None
        self.last_tick = clock.monotonic()
        self.started_at = clock.monotonic()
        self.polls = 0
        self._pruned_at = float("-inf")
        self.stop_requested = threading.Event()
        self._second_stop = threading.Event()
        self.reload_requested = threading.Event()
        self._coordinate_soon = threading.Event()
        self._state_failing = False
        self._poll_errors = logs.RepeatLimiter()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="imds")
        self.transition_listeners: list[Callable[[list[Transition]], None]] = []
        self.tick_listeners: list[Callable[[], None]] = []
        self.services = Services(config=config, clock=clock, rotation=self.rotation, health=self.health,
                                 store=self.store, metrics=self.metrics, vm_name=self.vm_name)
        self.runner = Runner(instantiate(config.handlers, self.services), self.services, dry_run=config.dry_run,
                             on_result=self._handler_result)
        self.transition_listeners.append(lambda trs: [self.runner.submit(t) for t in trs])
        self.coordinator = Coordinator(config.coordination, approve=lambda ids: self.imds.approve(ids), store=self.store,
                                       clock=clock, metrics=self.metrics, token_reader=self.peer_token,
                                       poll_interval=config.imds.poll_interval, on_change=self.wake_coordination,
                                       gates=config.gates, local_health=self._health_json,
                                       warning_as_error=config.health.consider_warning_as_error,
                                       health=self.health)  # fleet: peers_file problems in health
        self.profile: Profile = self._update_profile()
        self.rules = RuleEngine(config.health_rules, self.health, clock, self.metrics)

    # --- construction -------------------------------------------------------------------

    def _make_client(self, config: Config) -> ImdsClient:
        c = config.imds
        return ImdsClient(c.endpoint, c.api_version, timeout=c.timeout, first_timeout=c.first_timeout,
                          compute_api_version=c.compute_api_version, clock=self.clock, metrics=self.metrics,
                          session=self._session)

    def start(self) -> None:
        """Load the state, find this VM's name, report initial health."""
        report = self.store.load()
        if report.problem:
            self.log.error("state.corrupt" if report.moved_aside else "state.unreadable", problem=report.problem,
                           moved_aside=report.moved_aside, path=str(self.store.path))
            self.health.set("state", "load", HealthState.WARNING, f"{report.problem}; started fresh"
                            + (f" (old file kept at {report.moved_aside})" if report.moved_aside else ""))
        self.tracked = self.store.tracked()
        self.log.info("daemon.started", events=report.events, state_dir=str(self.store.dir),
                      endpoint=self.config.imds.endpoint, dry_run=self.config.dry_run, boot_id=self.boot_id)
        self.health.set("imds", "poll", HealthState.OK, "starting: no poll yet")
        if self.rotation.undrain(STOP_DRAIN):
            self.log.info("rotation.undrained", key=STOP_DRAIN, reason="maintd started again")
        if self.vm_name is None:
            self._resolve_identity(attempts=5)
        self.runner.resume(self.tracked)
        self.rules.start()

    def _resolve_identity(self, attempts: int) -> None:
        """Ask IMDS for compute.name (tenacity: a few tries at start, then once per poll cycle)."""
        retrying = retrying_on(self.clock, retry_if=is_transient, attempts=attempts, cancel=self.stop_requested,
                               maximum=min(10.0, self.config.imds.max_backoff))
        try:
            identity = retrying(self.imds.compute_identity)  # fleet: the whole identity, for peer addressing
            self.vm_name = identity.name
            self.coordinator.identity = identity  # fleet
        except ImdsError as exc:
            self.log.error("identity.failed", error=str(exc), body=exc.body[:200] or None,
                           hint="set identity.name in the config if IMDS compute metadata is not available")
            self.health.set("imds", "identity", HealthState.ERROR, f"cannot learn this VM's name from IMDS: {exc}")
            return
        self.services.vm_name = self.vm_name
        self.log.info("identity.resolved", vm_name=self.vm_name)
        self.health.set("imds", "identity", HealthState.OK, f"this VM is {self.vm_name}")

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        """Tick until a stop is requested."""
        while not self.stop_requested.is_set():
            self.tick()
            self._sleep_until_due()

    def _sleep_until_due(self) -> None:
        wait = self.next_poll - self.clock.monotonic()
        if self.notifier.watchdog_interval is not None:
            wait = min(wait, self.notifier.watchdog_interval)
        if wait > 0 and not (self.stop_requested.is_set() or self.reload_requested.is_set()
                             or self._coordinate_soon.is_set()):
            self.clock.sleep(wait)

    def tick(self) -> list[Transition]:
        """One pass: reload if asked, poll if due, hand transitions on, flush pending state."""
        now = self.clock.monotonic()
        self.last_tick = now
        self.metrics.loop_last_tick.set(self.clock.now().timestamp())
        if self.reload_requested.is_set():
            self.reload_requested.clear()
            self.reload()
        transitions: list[Transition] = []
        if now >= self.next_poll:
            self._coordinate_soon.clear()
            transitions = self._poll_and_schedule(now)
        elif self._coordinate_soon.is_set():
            self._coordinate_soon.clear()
            if self.last_success is not None and now - self.last_success <= 2 * self.config.imds.poll_interval:
                self._coordinate()
        self._prune_state(now)
        self._check_state()
        self._update_imds_health()
        self.update_rotation_metrics()
        for listener in self.tick_listeners:
            listener()
        self.notifier.watchdog(self.clock.monotonic())
        return transitions

    def _poll_and_schedule(self, now: float) -> list[Transition]:
        interval = self.config.imds.poll_interval
        if self.vm_name is None:
            self._resolve_identity(attempts=1)
            if self.vm_name is None:
                self.failures += 1
                self.next_poll = now + next_poll_delay(self.failures, interval, self.config.imds.max_backoff, None)
                return []
        transitions: list[Transition] = []
        retry_after = None
        try:
            result = self._fetch()
        except ImdsError as exc:
            self._poll_failed(exc)
            retry_after = exc.retry_after
        else:
            transitions = self._poll_succeeded(result)
        if self.failures:
            self.next_poll = self.clock.monotonic() + next_poll_delay(
                self.failures, interval, self.config.imds.max_backoff, retry_after)
        else:
            self.next_poll += interval
            if self.next_poll < self.clock.monotonic() - interval:
                self.next_poll = self.clock.monotonic()  # fell behind (suspend, slow call): no burst of catch-up polls
        return transitions

    def _fetch(self) -> PollResult:
        """Run the GET on the worker, pinging the watchdog while it is under way."""
        future = self._pool.submit(self.imds.get_document)
        while True:
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                self.notifier.watchdog(self.clock.monotonic())
                self.last_tick = self.clock.monotonic()
                if self.stop_requested.is_set():
                    raise ImdsError("stopping during a poll") from None

    def _poll_failed(self, exc: ImdsError) -> None:
        self.failures += 1
        self.metrics.poll_failures.set(self.failures)
        verdict = self._poll_errors.failure(f"{type(exc).__name__}:{exc.status}", self.clock.monotonic())
        fields: dict[str, Any] = {"error": str(exc), "code": exc.code, "failures": self.failures}
        if exc.body:
            fields["body"] = exc.body[:500]
        if isinstance(exc, ImdsRequestRejected):
            fields["hint"] = ("IMDS says maintd's request is malformed: check imds.api_version, and that no proxy "
                              "or X-Forwarded-For header is in the path")
        if verdict == "first":
            self.log.error("poll.failed", **fields)
        elif verdict == "summary":
            self.log.error("poll.still_failing", **fields, since_seconds=round(
                self.clock.monotonic() - (self._poll_errors.first_at or 0), 1))
        if isinstance(exc, ImdsRequestRejected):
            self.health.set("imds", "request", HealthState.ERROR, f"IMDS rejected maintd's request ({exc.status}): "
                            f"{exc.body[:200]}")

    def _poll_succeeded(self, result: PollResult) -> list[Transition]:
        streak = self._poll_errors.success()
        if streak:
            self.log.info("poll.recovered", failed_polls=streak)
        self.failures = 0
        self.metrics.poll_failures.set(0)
        self.polls += 1
        self.last_success = self.clock.monotonic()
        self.metrics.poll_last_success.set(self.clock.now().timestamp())
        self.health.remove("imds", "request")
        transitions = [] if result.unchanged or result.document is None else self.process_document(result.document)
        self._coordinate()
        return transitions

    def _update_profile(self) -> Profile:
        profile, selection = in_force(self.config.profiles, self.clock.now())
        previous = getattr(self, "profile", None)
        if previous is None or previous.name != profile.name:
            for p in self.config.profiles:
                self.metrics.profile_active.labels(p.name).set(1 if p.name == profile.name else 0)
            if previous is not None:
                self.log.info("profile.changed", profile=profile.name, previous=previous.name,
                              approval=profile.approval)
        self.profile = profile
        self.profile_next_change = selection.next_change
        self.services.profile = profile
        return profile

    def _coordinate(self) -> None:
        """Approval decisions, right after a successful poll (never on stale data)."""
        if self.vm_name is None:
            return
        self._update_profile()
        self.coordinator.tick(self.tracked, self.vm_name, self.profile, self.config.dry_run, self.runner.pending)

    def process_document(self, document: Document) -> list[Transition]:
        """Diff a fresh document against what is tracked, persist, and hand transitions on."""
        assert self.vm_name is not None
        previous = self.document
        if previous and previous.incarnation is not None and document.incarnation is not None \
                and document.incarnation < previous.incarnation:
            self.log.warning("imds.incarnation_reset", previous=previous.incarnation, current=document.incarnation)
        for skipped in document.skipped:
            self.metrics.events_malformed.inc()
            self.log.warning("event.malformed", index=skipped.index, reason=skipped.reason, event_id=skipped.event_id)
        self.document = document
        if document.incarnation is not None:
            self.metrics.document_incarnation.set(document.incarnation)
        now = self.clock.now()
        tracked, transitions = diff(self.tracked, document, vm_name=self.vm_name, boot_id=self.boot_id, now=now)
        self.tracked = tracked
        try:
            self.store.apply(tracked, transitions)
        except StateError as exc:
            self._state_failed(exc)
        for tr in transitions:
            self._log_transition(tr)
        self._update_event_metrics()
        if transitions:
            for listener in self.transition_listeners:
                listener(transitions)
        return transitions

    def _log_transition(self, tr: Transition) -> None:
        e = tr.event
        self.metrics.transitions.labels(tr.kind, e.type_label).inc()
        fields: dict[str, Any] = {"event_id": e.event_id, "event_type": e.event_type, "status": e.status,
                                  "names_self": tr.names_self, "resources": len(e.resources)}
        if tr.kind == "appeared":
            fields.update(not_before=e.not_before.isoformat() if e.not_before else None, source=e.source,
                          duration_seconds=e.duration_seconds, live_migration=e.live_migration,
                          description=e.description)
            if e.not_before is not None:
                notice = (e.not_before - tr.at).total_seconds()
                fields["notice_seconds"] = round(notice, 1)
                self.metrics.event_notice.labels(e.type_label).observe(max(0.0, notice))
        if tr.previous_status:
            fields["previous_status"] = tr.previous_status
        name = f"event.{tr.outcome}" if tr.kind == "vanished" and tr.outcome else f"event.{tr.kind}"
        self.log.info(name, **fields)

    def _update_event_metrics(self) -> None:
        self.metrics.events.clear()
        counts: dict[tuple[str, str, str], int] = {}
        for t in self.tracked.values():
            key = (t.event.type_label, t.event.status if t.event.status in ("Scheduled", "Started") else "Other",
                   "self" if t.names_self else "other")
            counts[key] = counts.get(key, 0) + 1
        for key, n in counts.items():
            self.metrics.events.labels(*key).set(n)
        self.metrics.next_maintenance.clear()
        for label, when in next_maintenance(self.tracked.values()).items():
            self.metrics.next_maintenance.labels(label).set(when.timestamp())
        pending = [t for t in self.tracked.values() if t.names_self]
        if pending:
            self.health.set("maintenance", "pending", HealthState.OK,
                            ", ".join(f"{t.event.event_type} {t.event.status}" for t in pending))
        else:
            self.health.remove("maintenance", "pending")

    def _update_imds_health(self) -> None:
        c = self.config.imds
        now = self.clock.monotonic()
        since = self.last_success if self.last_success is not None else self.started_at
        if self.failures and now - since >= c.stale_after:
            self.health.set("imds", "poll", HealthState.ERROR,
                            f"no successful poll for {now - since:.0f}s ({self.failures} failed in a row)")
        elif self.failures >= c.warn_after_failures:
            self.health.set("imds", "poll", HealthState.WARNING, f"{self.failures} polls failed in a row")
        elif self.last_success is not None:
            self.health.set("imds", "poll", HealthState.OK, "polling")

    def _state_failed(self, exc: StateError) -> None:
        self.metrics.state_write_failures.inc()
        self.log.error("state.write_failed", error=str(exc), hint="free space or make the state dir writable; "
                       "changes are kept in memory and written when the disk accepts them")

    def _prune_state(self, now: float) -> None:
        """Drop finished events older than `state.retention`, checked every min(60 s, retention / 4)."""
        if now - self._pruned_at < min(PRUNE_EVERY, self.config.state.retention / 4):
            return
        self._pruned_at = now
        try:
            gone = self.store.prune(self.clock.now())
        except StateError as exc:  # pruned in memory; the write is retried like any other
            self._state_failed(exc)
            return
        if gone:
            self.log.info("state.pruned", events=len(gone), retention_seconds=self.config.state.retention)

    def _check_state(self) -> None:
        """Retry a pending write; report the disk's state whichever thread's write failed or recovered."""
        if self.store.dirty:
            try:
                self.store.flush()
            except StateError:
                self.metrics.state_write_failures.inc()
        error = self.store.write_error
        if error and not self._state_failing:
            self._state_failing = True
            self.metrics.state_dirty.set(1)
            self.health.set("state", "write", HealthState.ERROR, f"state not saved: {error}")
        elif self._state_failing and not error and not self.store.dirty:
            self._state_failing = False
            self.metrics.state_dirty.set(0)
            self.log.info("state.write_recovered")
            self.health.set("state", "write", HealthState.OK, "state saved")

    def describe_plan(self, tr: Transition) -> dict[str, Any]:
        """What maintd would do for a transition (`maintd run --once`)."""
        from agent.runner import phase_for

        phase = phase_for(tr)
        handlers = [h.spec.name for h in self.runner.selected(phase, tr.event, tr.names_self)] if phase else []
        return {"transition": tr.kind, "event_id": tr.event.event_id, "event_type": tr.event.event_type,
                "names_self": tr.names_self, "outcome": tr.outcome, "phase": phase, "handlers": handlers}

    # --- views for the API (later parts extend these) ----------------------------------

    def is_ready(self, event_id: str) -> bool:
        """Whether this VM has finished preparing for the event (every scheduled handler settled)."""
        tracked = self.tracked.get(event_id)
        return tracked is not None and tracked.event.status == "Scheduled" and self.runner.is_ready(tracked)

    def _handler_result(self, event_id: str, handler: str, phase: str, result: Any) -> None:
        if result.outcome in ("failed", "timed_out"):
            self.health.set("handlers", handler, HealthState.WARNING,
                            f"{phase} run for {event_id} {result.outcome}: {result.detail}"[:500])
        elif result.outcome == "ok":
            self.health.remove("handlers", handler)
        tracked = self.tracked.get(event_id)
        if phase == "scheduled" and tracked is not None and self.vm_name and self.runner.is_ready(tracked):
            self.wake_coordination()  # fleet: the coordinator's tick pushes readiness to the acting leader

    def _health_json(self) -> dict[str, Any]:
        return self.health.to_json(self.config.health.consider_warning_as_error)

    def wake_coordination(self) -> None:
        """Decide about approvals now rather than after the next poll (a VM just became ready)."""
        self._coordinate_soon.set()
        self._wake()

    def _wake(self) -> None:
        """Cut the loop's sleep short (signal-safe)."""
        wake = getattr(self.clock, "wake", None)
        if wake:
            wake()

    def extra_status(self) -> dict[str, Any]:
        """Profile fields for /v1/status."""
        nxt = self.profile_next_change
        return {"profile": self.profile.name, "profile_approval": self.profile.approval,
                "profile_next_change": nxt.isoformat().replace("+00:00", "Z") if nxt else None,
                **self.coordinator.status(self.tracked, self.vm_name)}  # fleet: peer addressing

    def extra_event_view(self, event_id: str) -> dict[str, Any]:
        """Coordination fields for /v1/events/{id}."""
        return self.coordinator.view(event_id)

    def manual_approve(self, event_id: str) -> dict[str, Any]:
        """Record an operator's approval (`maintd approve`); the coordinator sends it."""
        self.store.record(event_id, "manual_approval", {"at": self.clock.now().isoformat(), "by": "api"},
                          journal="approval.manual")
        self.log.info("approval.manual", event_id=event_id)
        return {"event_id": event_id, "manual_approval": "recorded"}

    def peer_token(self) -> str | None:
        """The shared token peers must present on /v1 reads (None: reads are open)."""
        return read_secret(self.config.coordination.token_file)

    def server_token(self) -> str | None:
        """The bearer token for mutating endpoints from non-loopback clients."""
        return read_secret(self.config.server.token_file)

    def update_rotation_metrics(self) -> None:
        """Export whether the probe answers 200."""
        self.metrics.in_rotation.set(1 if self.rotation.verdict().in_rotation else 0)
        self.metrics.health_state.set(int(self.health.aggregate(self.config.health.consider_warning_as_error)))

    def serve(self, sock: Any = None) -> ApiServer:
        """Start the HTTP server (on a socket-activated `sock` when systemd passed one)."""
        from agent.api import LocalApi

        c = self.config.server
        self.server = ApiServer(None if sock is not None else c.listen, LocalApi(self), self.metrics,
                                probe_path=self.config.probe.path, token_reader=self.server_token,
                                max_body_bytes=c.max_body_bytes, read_timeout=c.read_timeout, sock=sock)
        self.server.serve_in_background()
        self.log.info("server.listening", url=self.server.url, socket_activated=sock is not None)
        probe = self.config.probe
        if probe.mode == "tcp" and probe.listen:
            self.tcp_probe = TcpProbe(probe.listen, lambda: self.rotation.verdict().in_rotation)
            self.tcp_probe.start()
        return self.server

    # --- control ------------------------------------------------------------------------

    def stuck_for(self) -> float:
        """Seconds the loop is past the time it should have ticked again (0 when alive)."""
        c = self.config.imds
        allowance = max(c.poll_interval, c.max_backoff) + c.first_timeout + 5.0
        return max(0.0, self.clock.monotonic() - self.last_tick - allowance)

    def reload(self) -> bool:
        """Re-read the config file; a refused file keeps the running config (and says why)."""
        if not self.config_path:
            return False
        self.notifier.reloading()
        try:
            new = config_mod.load(self.config_path)
        except ConfigError as exc:
            self.metrics.config_reloads.labels("failed").inc()
            self.log.error("config.reload_failed", error=str(exc), kept="the running config")
            self.health.set("config", "reload", HealthState.WARNING, f"reload refused, old config kept: {exc}")
            self.notifier.ready("reload refused; old config kept")
            return False
        self.apply_config(new)
        self.metrics.config_reloads.labels("ok").inc()
        self.health.remove("config", "reload")
        self.log.info("config.reloaded", path=self.config_path)
        self.notifier.ready("config reloaded")
        return True

    def apply_config(self, new: Config) -> None:
        """Switch to a new config in place (what a restart would not be needed for)."""
        old = self.config
        if new.server != old.server or new.state.dir != old.state.dir:
            self.log.warning("config.needs_restart", keys="server.*, state.dir",
                             hint="these take effect after systemctl restart maintd")
            new = replace(new, server=old.server, state=replace(new.state, dir=old.state.dir))
        logs.configure(new.log.format, new.log.level)
        self.rotation.configure(new.probe.fail_on, new.health.consider_warning_as_error)
        if new.imds != old.imds:
            self.imds = self._make_client(new)
        if new.identity != old.identity:
            self.vm_name = None if new.identity.name == "auto" else new.identity.name
            self.services.vm_name = self.vm_name
        self.services.config = new
        if new.handlers != old.handlers:
            self.runner.handlers = instantiate(new.handlers, self.services)
            for h in self.runner.handlers:
                self.metrics.init_handler(h.spec.name, h.spec.phases)
        self.runner.dry_run = new.dry_run
        self.rules.update(new.health_rules)
        self.coordinator.settings = new.coordination
        self.coordinator.gates = new.gates
        self.coordinator.warning_as_error = new.health.consider_warning_as_error
        self.config = new
        self._update_profile()

    def request_stop(self, *_: Any) -> None:
        """Ask the loop to stop (signal-safe)."""
        self.stop_requested.set()
        self._wake()

    def request_reload(self, *_: Any) -> None:
        """Ask the loop to reload the config (signal-safe)."""
        self.reload_requested.set()
        self._wake()

    def install_signals(self) -> None:
        """SIGTERM/SIGINT stop, SIGHUP reloads."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)

    def should_drain_on_stop(self) -> bool:
        """probe.drain_on_stop: always, never, or only when the whole system is shutting down."""
        mode = self.config.probe.drain_on_stop
        return mode == "always" or (mode == "shutdown" and system_is_stopping())

    def drain_for_stop(self) -> None:
        """Leave rotation and wait for the LB to notice before exiting (a role's OnStop)."""
        probe = self.config.probe
        wait = probe.lb_timeout + probe.drain_grace
        self.rotation.drain(STOP_DRAIN, "maintd is stopping", self.clock.now())
        self.update_rotation_metrics()
        self.log.warning("rotation.drained", key=STOP_DRAIN, reason="maintd is stopping", wait_seconds=wait)
        self.notifier.status(f"draining for {wait:.0f}s before exit")
        self.clock.wait(self._second_stop, wait)

    def shutdown(self) -> None:
        """Drain if configured, let handlers finish briefly, flush state, tell systemd we are stopping."""
        self.notifier.stopping()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self._second_stop.set())  # a second SIGTERM ends the drain wait
        if self.should_drain_on_stop():
            self.drain_for_stop()
        self.runner.stop(HANDLER_STOP_GRACE)
        self.rules.stop()
        self.coordinator.stop()
        if self.tcp_probe is not None:
            self.tcp_probe.stop()
        if self.server is not None:
            self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.store.flush()
        except StateError as exc:
            self.log.error("state.write_failed", error=str(exc), at="shutdown")
        self.log.info("daemon.stopped", polls=self.polls)


def build(config: Config, clock: Clock, *, config_path: str | None = None, metrics: Metrics | None = None,
          session: requests.Session | None = None, boot_id: str | None = None,
          notifier: Notifier | None = None) -> Daemon:
    """The daemon with every part the config asks for, wired together."""
    return Daemon(config, clock=clock, metrics=metrics, session=session, boot_id=boot_id, notifier=notifier,
                  config_path=config_path)
