"""The loop: polls on monotonic deadlines, hands what changed on, acts on signals.

The loop polls once per `imds.poll_interval` (deadline += interval, so 3600 polls take 3600 s
± one interval) and never waits on a handler, a peer or the disk: handlers and peer requests run on
worker threads, record in the state store and hand their word to the loop's `Inbox` (a queue and a
wake; nothing of the loop's is read on their threads). Each pass takes the inbox, polls if due, and
hands one frozen `Tick` (the pass's clock reading, the events, this VM, the profile in force, the
pending handlers) down to the coordinator and the preparation. The poll is `poller.py`'s: the IMDS
request runs on the loop's own thread with one deadline for the whole exchange (a stop interrupts it
at once); only IMDS's slow first answer, longer than a watchdog interval, waits on a thread of its
own while the loop keeps pinging the systemd watchdog. Signal handlers only record (`Control`: flags
that take no lock, and every signal wakes the loop's sleep through its self-pipe); the loop acts on
them on its next wake.

The parts are built in `wiring.py`; the pass's budget and fleet steps are `fleet_pass.py`'s, the identity
lookup's thread `identity_lookup.py`'s; what the loop reports (logs, metrics, health) is worded in
`report.py`; what the HTTP API shows is read from the `LoopView` the loop publishes each tick.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

from agent.clock import Clock, SignalFlag
from agent.config.config import Config
from agent.errors import ImdsError
from agent.health.health_store import HealthState
from agent.health.tcp_probe import TcpProbe
from agent.http.routes import ApiServer
from agent.imds.imds_client import PollResult
from agent.loop.api import LoopView
from agent.loop.inbox import Inbox, Taken
from agent.loop.poller import Poller
from agent.loop.report import Reporter
from agent.loop.tick import Tick
from agent.loop.wiring import STOP_DRAIN, Parts, serve
from agent.model.events import Document
from agent.model.outcomes import PHASE_SCHEDULED
from agent.model.tracker import Tracked, Transition, diff
from agent.policy.approval_policy import Profile, in_force
from agent.state.state_file import LoadReport
from agent.systemd import Notifier
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics

HANDLER_STOP_GRACE = 10.0
"""Seconds running handlers get to finish when maintd stops, before they are cut short."""
PRUNE_EVERY = 60.0
"""Longest gap between two checks for finished events past `state.retention`."""


class Control:
    """What the loop is asked from outside (stop, reload; during a stop's drain, a second stop) and the
    loop's own sleep, which every request cuts short.

    A signal handler runs on the main thread between any two bytecodes, also while the loop holds a
    lock (a `threading.Event`'s, in its `wait` or `clear`): a handler that takes a lock can deadlock
    the loop. So handlers only set `SignalFlag`s and interrupt a poll's socket (neither takes a lock),
    `signal.set_wakeup_fd` makes every signal write a byte to the sleep's self-pipe, and the loop acts
    on the flags on its next wake (the Supervisor way).
    """

    def __init__(self, clock: Clock, interrupt_poll: Callable[[], None]) -> None:
        self.sleeper = clock.sleeper()
        self.stop, self.reload, self.second_stop = (SignalFlag(clock, self.sleeper) for _ in range(3))
        self._interrupt_poll = interrupt_poll
        self._installed = False

    def request_stop(self, *_: Any) -> None:
        """Ask the loop to stop; a poll under way fails now, not at its timeout (signal-safe)."""
        self.stop.set()
        self._interrupt_poll()

    def request_reload(self, *_: Any) -> None:
        """Ask the loop to reload the config (signal-safe)."""
        self.reload.set()

    def install(self) -> None:
        """SIGTERM/SIGINT stop, SIGHUP reloads; every signal wakes the loop (main thread only)."""
        signal.set_wakeup_fd(self.sleeper.fileno(), warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGHUP, self.request_reload)
        self._installed = True

    def stopping(self) -> None:
        """From now on a SIGTERM ends the stop's drain wait (main thread only); only where `install` took the
        signals over: a daemon run inside another program (the tests) leaves its SIGTERM alone."""
        if self._installed:
            signal.signal(signal.SIGTERM, lambda *_: self.second_stop.set())


class Daemon:
    """One maintd instance. `start()`, then `tick()` repeatedly (or `run()`), then `shutdown()`."""

    def __init__(self, config: Config, clock: Clock, *, metrics: Metrics | None = None,
                 boot_id: str | None = None, notifier: Notifier | None = None, config_path: str | None = None) -> None:
        self.control = Control(clock, lambda: self.parts.imds.interrupt())
        self.inbox = Inbox(self.control.sleeper)
        self.parts = Parts(config, clock, self.inbox, metrics=metrics, boot_id=boot_id, notifier=notifier)
        p = self.parts
        self.config_path = config_path
        self.clock = clock
        self.metrics = p.metrics
        self.notifier = p.notifier
        self.store = p.store
        self.health = p.health
        self.rotation = p.rotation
        self.runner = p.runner
        self.readiness = p.readiness
        self.coordinator = p.coordinator
        self.rules = p.rules
        self.preparation = p.preparation
        self.report = Reporter(p.metrics, p.health, clock)
        self.log = logs.get("daemon")
        self.server: ApiServer | None = None
        self.loaded: LoadReport | None = None
        self.tcp_probe: TcpProbe | None = None
        self.vm_name: str | None = p.vm_name
        self.tracked: dict[str, Tracked] = {}
        self.document: Document | None = None
        self.poller = Poller(p, clock, p.notifier, self.report, alive=self._alive,
                             identity_known=self._identity_changed)
        self.cadence = self.poller.cadence
        self.last_tick = clock.monotonic()
        self._pruned_at = float("-inf")
        self._resume_pending = False  # `start` sets it: work resumes at the first successful poll
        self.profile: Profile | None = None
        self._update_profile(clock.now())
        self.view = self._publish()
        self.report.follow_loop(lambda: self.view.last_tick, lambda: self.view.last_success)

    @property
    def config(self) -> Config:
        """The config in force (replaced on reload)."""
        return self.parts.config

    @property
    def boot_id(self) -> str:
        return self.parts.boot_id

    def _publish(self) -> LoopView:
        """Replace the view the API reads (an immutable snapshot of the loop's own fields)."""
        assert self.profile is not None
        self.view = LoopView(config=self.config, vm_name=self.vm_name, tracked=self.tracked,
                             incarnation=self.document.incarnation if self.document else None,
                             failures=self.cadence.failures, polls=self.cadence.polls,
                             last_success=self.cadence.last_success,
                             last_tick=self.last_tick, profile=self.profile,
                             profile_next_change=self.profile_next_change, restart_needed=self.parts.restart_needed)
        return self.view

    def load(self) -> LoadReport:
        """Load the state (drains, events, results): before the probe or /healthz may answer anything."""
        if self.loaded is None:
            self.loaded = self.report.state_loaded(self.store)
            self.tracked = self.store.tracked()
            if self.rotation.undrain(STOP_DRAIN):
                self.log.info("rotation.undrained", key=STOP_DRAIN, reason="maintd started again")
        return self.loaded

    def start(self) -> None:
        """Load the state (unless `load` did), find this VM's name, report initial health."""
        loaded = self.load()
        self.log.info("daemon.started", events=loaded.events, state_dir=str(self.store.dir),
                      endpoint=self.config.imds.endpoint, dry_run=self.config.dry_run, boot_id=self.boot_id)
        self.health.set("imds", "poll", HealthState.OK, "starting: no poll yet")
        if self.vm_name is None:
            self.parts.identity_lookup.start(attempts=5)  # off the loop: the first polls wait for it, the loop goes on
        self._resume_pending = True  # from the first successful poll, with the events as IMDS shows them then
        self.rules.start()
        self._publish()

    def resolve_identity(self, attempts: int) -> None:
        """Learn this VM's name from IMDS now, on this thread (`maintd run --once`; the loop never does)."""
        identity = self.parts.identity_lookup.ask(attempts, self.control.stop)
        if identity is not None:
            self.parts.use_identity(identity)
        self._identity_changed()

    def _identity_changed(self) -> None:
        """The name in force reaches the loop and the handlers' settings."""
        self.vm_name = self.parts.vm_name
        self.parts.publish_settings(self.profile)

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        """Tick until a stop is requested."""
        while not self.control.stop.is_set():
            self.tick()
            self._sleep_until_due()

    def _sleep_until_due(self) -> None:
        wait = min(self.cadence.next_poll, budget_deadline(self.parts)) - self.clock.monotonic()
        if self.notifier.watchdog_interval is not None:
            wait = min(wait, self.notifier.watchdog_interval)
        if wait > 0 and not (self.control.stop.is_set() or self.control.reload.is_set() or self.inbox.waiting()):
            self.control.sleeper.sleep(wait)

    def tick(self) -> list[Transition]:
        """One pass: the budget's lease first, reload if asked, take the inbox, poll if due, build the pass's `Tick`
        and hand it down (coordinator, preparation), flush pending state."""
        began = self.clock.monotonic()
        self.last_tick = began
        self.parts.fleet_pass.look_at_budget(self.tracked)  # B2: a lost place is lost before anything acts on it
        if self.control.reload.is_set():
            self.control.reload.clear()
            self.reload()
        taken = self._take_inbox()
        due = self.poller.due(began)
        polled = self.poller.poll(began, named=self.vm_name is not None) if due else None
        now = self.clock.now()
        profile = self._update_profile(now)
        transitions = [] if polled is None else self._poll_succeeded(polled, now)
        tick = Tick.of(self.tracked, self.vm_name, profile, self.config.dry_run, self.readiness.pending, now=now,
                       monotonic=self.clock.monotonic(), identity=self.parts.identity)
        if polled is not None or (not due and self._coordination_wanted(taken, tick)):
            self.coordinator.tick(tick)  # right after a successful poll, or a VM just became ready: never stale
        self.preparation.tick(tick, self.parts.fleet_pass.leave_gate(tick))
        self.parts.fleet_pass.record_ended(self.vm_name)
        self._prune_state(began)
        self.report.state_write_status(self.store)
        c = self.cadence
        self.report.imds_health(self.config.imds, c.failures, c.last_success, c.started_at)
        self._publish()
        self.notifier.watchdog(self.clock.monotonic())
        return transitions

    def _take_inbox(self) -> Taken:
        """What other threads handed the loop since its last pass; each finished run reported (health)."""
        taken = self.inbox.take()
        for f in taken.finished:
            self.report.handler_result(f.event_id, f.handler, f.phase, f.result)
        return taken

    def _coordination_wanted(self, taken: Taken, tick: Tick) -> bool:
        """Between polls: decide now when a scheduled run just made this VM ready for an event, or another VM's
        word came in, while the last poll is fresh (never on stale data)."""
        last = self.cadence.last_success
        if last is None or tick.monotonic - last > 2 * self.config.imds.poll_interval:
            return False
        return taken.changed or any(f.phase == PHASE_SCHEDULED and tick.ready(f.event_id) for f in taken.finished)

    def _alive(self) -> None:
        self.last_tick = self.clock.monotonic()
        self._publish()

    def _poll_succeeded(self, result: PollResult, now: datetime) -> list[Transition]:
        known = self.tracked
        transitions = [] if result.unchanged or result.document is None else self.process_document(result.document,
                                                                                                  now)
        if self._resume_pending:  # once after a start: the events known before it, as IMDS shows them now (0102)
            self._resume_pending = False
            self.preparation.resume({e: t for e, t in self.tracked.items() if e in known}, now)  # to the runner
            self.parts.keeper.wake()  # what handlers keep (silences) is taken up again after a restart
        return transitions

    def dry_poll(self) -> tuple[Document, list[Transition]]:
        """One poll diffed against the saved state, acting on nothing (`maintd run --once`)."""
        assert self.vm_name is not None
        document = self.poller.fetch().document
        if document is None:
            raise ImdsError("IMDS answered 304 Not Modified to a first request")
        _, transitions = diff(self.store.tracked(), document, vm_name=self.vm_name, boot_id=self.boot_id,
                              now=self.clock.now())
        return document, transitions

    def process_document(self, document: Document, now: datetime) -> list[Transition]:
        """Diff a fresh document against what is tracked, persist, and hand transitions on (`now`: the pass's)."""
        assert self.vm_name is not None
        self.report.document(document, self.document)
        self.document = document
        tracked, transitions = diff(self.tracked, document, vm_name=self.vm_name, boot_id=self.boot_id, now=now)
        self.tracked = tracked
        self.store.apply(tracked, transitions)  # in memory now, written in the background
        for tr in transitions:
            self.report.transition(tr)
        self.report.events(tracked)
        self.preparation.submit(transitions, now)
        return transitions

    def _update_profile(self, now: datetime) -> Profile:
        """The profile in force at `now`, chosen once per pass; a change is reported and reaches the handlers."""
        profile, selection = in_force(self.config.profiles, now)
        previous = self.profile
        self.report.profile(profile, previous, self.config.profiles)
        self.profile = profile
        self.profile_next_change = selection.next_change
        if profile != previous:
            self.parts.publish_settings(profile)
        return profile

    def _prune_state(self, now: float) -> None:
        """Drop finished events older than `state.retention`, checked every min(60 s, retention / 4)."""
        if now - self._pruned_at < min(PRUNE_EVERY, self.config.state.retention / 4):
            return
        self._pruned_at = now
        gone = self.store.prune(self.clock.now())  # in memory now, written in the background
        if gone:
            self.log.info("state.pruned", events=len(gone), retention_seconds=self.config.state.retention)

    def serve(self, sock: Any = None) -> ApiServer:
        """Start the HTTP server (on a socket-activated `sock` when systemd passed one)."""
        self.server, self.tcp_probe = serve(self.parts, lambda: self.view, sock)
        self.log.info("server.listening", url=self.server.url, socket_activated=sock is not None)
        return self.server

    # --- control ------------------------------------------------------------------------

    def reload(self) -> bool:
        """Re-read the config file; a refused file keeps the running config (and says why)."""
        if not self.config_path:
            return False
        identity = self.config.identity
        if not self.parts.reload(self.config_path):
            return False
        if self.config.identity != identity:
            self._identity_changed()
        self._update_profile(self.clock.now())
        self.parts.publish_settings(self.profile)  # a reload may change the drain timings the settings carry
        self._publish()
        return True

    def shutdown(self) -> None:
        """Drain if configured, let handlers finish briefly, flush state, tell systemd we are stopping."""
        self.notifier.stopping()
        if threading.current_thread() is threading.main_thread():
            self.control.stopping()
        self.parts.drain_for_stop(self.control.second_stop)
        self.parts.stop(HANDLER_STOP_GRACE)
        self.report.state_write_status(self.store, retry=False)
        if self.tcp_probe is not None:
            self.tcp_probe.stop()
        if self.server is not None:
            self.server.close()
        self.log.info("daemon.stopped", polls=self.cadence.polls)


def budget_deadline(parts: Parts) -> float:
    """When the disruption budget needs the loop's next pass at the latest (monotonic; inf: no budget): its place's
    lease end (B2: lost on time, whatever `imds.poll_interval` or the IMDS backoff), its renewal, its next step."""
    return parts.budget.deadline() if parts.budget is not None else float("inf")
