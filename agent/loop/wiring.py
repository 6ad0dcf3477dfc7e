"""Building the agent's parts from a `Config`, and rebuilding what a reloaded config changes.

This is the one place that knows which part reads which config section: `Parts` makes them at
start, `Parts.reconfigure` applies a reloaded config to the running parts (what needs a restart is
kept and named), `serve` starts the HTTP server (and the TCP probe) over the API facade. The loop
(`daemon.py`) owns none of this: it only calls the parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.clock import Clock, Waitable
from agent.config import config as config_mod
from agent.config.config import Config, ServerConfig
from agent.coordination import backend_registry
from agent.coordination.backend import Backend, BackendParts, Carrier
from agent.coordination.coordinator import Coordinator
from agent.errors import ConfigError, kept_in_memory
from agent.handlers.base import Result, Services
from agent.handlers.registry import instantiate
from agent.handlers.spec import Settings
from agent.health.health_json import HealthView
from agent.health.health_store import HealthState, HealthStore
from agent.health.rotation import Rotation
from agent.health.sampling import RuleEngine
from agent.health.tcp_probe import TcpProbe
from agent.http.routes import ApiServer
from agent.imds.imds_client import ImdsClient
from agent.loop.api import LocalApi, LoopView
from agent.loop.event_end import fleet_history
from agent.loop.fleet_pass import FleetPass, history_group, lead_seconds, preparation_needs, rejoin_seconds
from agent.loop.identity_lookup import IdentityLookup
from agent.loop.inbox import Inbox
from agent.model.identity import Identity
from agent.policy.approval_policy import Profile
from agent.prepare.handler_runner import Runner
from agent.prepare.keeper import Keeper
from agent.prepare.preparation import Preparation
from agent.prepare.readiness import Readiness
from agent.state.state_store import Store
from agent.systemd import Notifier, system_is_stopping
from agent.telemetry import logs
from agent.telemetry.metrics import Metrics
from agent.trust.secretfile import SecretFiles

if TYPE_CHECKING:  # the budget's parts load only when the config asks for one (decision 0220)
    from agent.fleet.budget import Budget

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
STOP_DRAIN = "stop"
"""The rotation drain key maintd holds while it stops (removed when it starts again)."""
RESTART_KEYS: tuple[str, ...] = (
    "state.dir", *(f"server.{f.name}" for f in fields(ServerConfig)), "probe.path", "probe.mode", "probe.listen",
    "coordination.max_concurrency", "coordination.backend", *backend_registry.sections(), "coordination.budget")
"""Keys a reload cannot apply to a running daemon (the listening sockets, the route table, the state dir,
the peer pools' size, the coordination backend — two protocols must never meet within one event): they
keep their running values until a restart. Every other key is applied by `Parts.reconfigure`
(tests/loop/test_reload.py holds every key of `Config` to one or the other)."""


def value_at(config: Any, key: str) -> Any:
    """The value of a dotted key (`probe.path`) in a config."""
    return reduce(getattr, key.split("."), config)


def with_value(config: Any, key: str, value: Any) -> Any:
    """`config` with the dotted key set to `value` (sections replaced, never changed in place)."""
    head, _, rest = key.partition(".")
    return replace(config, **{head: with_value(getattr(config, head), rest, value) if rest else value})


def changed_keys(old: Config, new: Config, keys: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `keys` whose value differs between two configs."""
    return tuple(k for k in keys if value_at(old, k) != value_at(new, k))


def with_values_of(old: Config, new: Config, keys: tuple[str, ...]) -> Config:
    """`new` with `keys` as they are in `old`."""
    return reduce(lambda cfg, k: with_value(cfg, k, value_at(old, k)), changed_keys(old, new, keys), new)


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    """The kernel's boot id (changes on every boot), or "" where there is none."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def make_imds_client(config: Config, clock: Clock, metrics: Metrics) -> ImdsClient:
    """The IMDS client for `config.imds`."""
    c = config.imds
    return ImdsClient(c.endpoint, c.api_version, timeout=c.timeout, first_timeout=c.first_timeout,
                      compute_api_version=c.compute_api_version, clock=clock, metrics=metrics)


class Parts:
    """Every part the config asks for, wired to each other and to the loop's inbox (the one way up).

    `config` is the config in force; `reconfigure` replaces it (and `imds`, the runner's handlers)
    on reload. Readers on other threads see either the old or the new object, never a mix.
    """

    def __init__(self, config: Config, clock: Clock, inbox: Inbox, *, metrics: Metrics | None = None,
                 boot_id: str | None = None,
                 notifier: Notifier | None = None) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.notifier = notifier or Notifier()
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        self.health = HealthStore(clock)
        self.secrets = SecretFiles(self.health.report_config_problem)
        s = config.state
        self.store = Store(s.dir, clock, retention=s.retention, journal_max_bytes=s.journal_max_bytes,
                           journal_keep=s.journal_keep)
        self.rotation = Rotation(self.store, self.health, config.probe.fail_on, config.health.consider_warning_as_error)
        self.metrics.follow_verdict(lambda: self.rotation.verdict().in_rotation,
                                    lambda: int(self.health.aggregate(self.config.health.consider_warning_as_error)))
        self.imds = make_imds_client(config, clock, self.metrics)
        self.vm_name: str | None = None if config.identity.name == "auto" else config.identity.name
        self.identity: Identity | None = None  # from IMDS compute, the loop's: the Tick hands it to the coordinator
        self.inbox = inbox
        self.services = Services(clock=clock, store=self.store, metrics=self.metrics, rotation=self.rotation,
                                 health=self.health)
        self.runner = Runner(instantiate(config.handlers, self.services), self.services, dry_run=config.dry_run,
                             on_result=self._handler_finished)
        self.readiness = Readiness.of(self.runner)
        self.keeper = Keeper(lambda: self.runner.handlers, clock)
        backend = self._backend()
        carrier = backend.carrier()
        self.budget = make_budget(self, carrier)
        if self.budget is not None and self.vm_name is not None:  # named in the config: no IMDS topology
            self.budget.identify(self.vm_name, "", "", "")
        self.preparation = Preparation(store=self.store, clock=clock, metrics=self.metrics, runner=self.runner,
                                       profiles=config.profiles, prepare=config.prepare, budget=self.budget is not None)
        self.coordinator = Coordinator(
            config.coordination, approve=lambda ids: self.imds.approve(ids), store=self.store, clock=clock,
            metrics=self.metrics, token_reader=self.peer_token, poll_interval=config.imds.poll_interval,
            on_change=inbox.coordination_changed, gates=config.gates, local_health=self.health_json,
            warning_as_error=config.health.consider_warning_as_error, health=self.health,
            backend=backend, budget=self.budget)
        self.history, self.event_ends = fleet_history(
            None if carrier is None else carrier.store, self.store, self.readiness, clock,
            self.metrics.lane_errors.labels("history").inc, self.history_group, self.budget)
        self.fleet_pass = FleetPass(self.budget, self.event_ends, self.preparation, self.rotation, self.store,
                                    clock)
        self.rules = RuleEngine(config.health_rules, self.health, clock, self.metrics)
        self.identity_lookup = IdentityLookup(clock, self.health, lambda: self.imds.compute_identity(),
                                              lambda: self.config.imds.max_backoff)
        self.restart_needed: tuple[str, ...] = ()

    def _backend(self) -> Backend:
        """The coordination backend the config chooses (`backend_registry`; only its code loads), from the parts
        any backend may need."""
        return backend_registry.build(BackendParts(
            lambda: self.config.coordination, self.clock, self.metrics, self.health,
            on_change=self.inbox.coordination_changed, poll_interval=lambda: self.config.imds.poll_interval,
            token_reader=self.peer_token, identity=lambda: self.coordinator.identity, local_health=self.health_json,
            warning_as_error=lambda: self.config.health.consider_warning_as_error,
            identity_token=lambda resource, client_id: self.imds.identity_token(resource, client_id),
            secret=self.secrets.read))

    def history_group(self) -> str:
        """The fleet history's group (read by the history and the API on each use)."""
        return history_group(self.budget, self.identity)

    def _handler_finished(self, event_id: str, handler: str, phase: str, result: Result) -> None:
        """On the handler's thread: the result to the loop's inbox (no loop state read), the keeper's wake."""
        self.inbox.handler_finished(event_id, handler, phase, result)
        self.keeper.wake()

    def peer_token(self) -> str | None:
        """The shared token peers must present on /v1 reads (None: reads are open)."""
        return self.secrets.read("coordination.token_file", self.config.coordination.token_file)

    def server_token(self) -> str | None:
        """The bearer token for mutating endpoints from non-loopback clients."""
        return self.secrets.read("server.token_file", self.config.server.token_file)

    def health_json(self) -> HealthView:
        """The health store as /v1/health shows it (also what the fleet gate reads of this VM)."""
        return self.health.to_json(self.config.health.consider_warning_as_error)

    def publish_settings(self, profile: Profile | None) -> None:
        """Hand the handlers one immutable snapshot of what they read (name, drain timings, profile)."""
        probe = self.config.probe
        identity = self.identity
        self.services.settings = Settings.for_profile(self.vm_name, probe.lb_timeout, probe.drain_grace, profile,
                                                      identity.computer_name if identity is not None else "")

    def reconfigure(self, new: Config) -> Config:
        """Apply a reloaded config to the running parts; returns the config now in force.

        Every key takes effect here, from one place, or is one of `RESTART_KEYS`: those keep their running
        values and are named (`reload.restart_needed`, `restart_needed` in `maintd status`) until a restart.
        """
        old = self.config
        self.restart_needed = changed_keys(old, new, RESTART_KEYS)
        if self.restart_needed:
            logs.get("daemon").warning("reload.restart_needed", keys=list(self.restart_needed),
                                       hint="these take effect after systemctl restart maintd")
        new = with_values_of(old, new, RESTART_KEYS)
        logs.configure(new.log.format, new.log.level)
        self.store.retention = new.state.retention
        self.store.journal_max_bytes = new.state.journal_max_bytes
        self.store.journal_keep = new.state.journal_keep
        self.rotation.configure(new.probe.fail_on, new.health.consider_warning_as_error)
        if new.imds != old.imds:
            self.imds.close()  # its kept poll socket: the new client opens its own
            self.imds = make_imds_client(new, self.clock, self.metrics)
        if new.identity != old.identity:  # as a fresh start with the new config: a name, or a lookup
            self.vm_name = None if new.identity.name == "auto" else new.identity.name
            self.identity = None
            self.identity_lookup.drop()  # a lookup under way answers for the old config: its result is dropped
        if new.handlers != old.handlers:
            self.runner.handlers = instantiate(new.handlers, self.services)
            for h in self.runner.handlers:
                self.metrics.init_handler(h.spec.name, h.spec.phases)
            self.keeper.wake()
        self.runner.dry_run = new.dry_run
        self.rules.update(new.health_rules)
        coordinator = self.coordinator
        coordinator.settings = new.coordination
        coordinator.gates = new.gates
        coordinator.warning_as_error = new.health.consider_warning_as_error
        coordinator.poll_interval = new.imds.poll_interval
        self.preparation.configure(new.profiles, new.prepare)
        self.config = new
        return new

    def use_identity(self, identity: Identity) -> None:
        """This VM is `identity`: its name for the loop, computer name and scale set for addressing peers."""
        self.vm_name = identity.name
        self.identity = identity
        if self.budget is not None:
            self.budget.identify(identity.name, identity.zone, identity.fault_domain, identity.scale_set)

    def take_identity(self) -> bool | None:
        """On the loop: apply a finished lookup; True when this VM's name is known now, False when IMDS could
        not tell (ask again later), None while no lookup has finished."""
        lookup = self.identity_lookup.take()
        if lookup is None:
            return None
        identity = lookup.result()
        if identity is not None and self.config.identity.name == "auto":  # not overtaken by a reload naming the VM
            self.use_identity(identity)
        return self.vm_name is not None

    def reload(self, path: str) -> bool:
        """Re-read the config file and apply it; a refused file keeps the running config (and says why)."""
        self.notifier.reloading()
        try:
            new = config_mod.load(path)
        except ConfigError as exc:
            self.metrics.config_reloads.labels("failed").inc()
            logs.get("daemon").error("config.reload_failed", error=str(exc), kept="the running config")
            self.health.set("config", "reload", HealthState.WARNING, f"reload refused, old config kept: {exc}")
            self.notifier.ready("reload refused; old config kept")
            return False
        self.reconfigure(new)
        self.metrics.config_reloads.labels("ok").inc()
        self.health.remove("config", "reload")
        logs.get("daemon").info("config.reloaded", path=path)
        self.notifier.ready("config reloaded")
        return True

    def drain_for_stop(self, cut_short: Waitable) -> None:
        """probe.drain_on_stop: leave rotation and wait for the LB to notice before exiting (a role's OnStop)."""
        probe = self.config.probe
        if not (probe.drain_on_stop == "always" or (probe.drain_on_stop == "shutdown" and system_is_stopping())):
            return
        wait = self.services.settings.drain_wait  # the profile in force may override lb_timeout/drain_grace
        self.rotation.drain(STOP_DRAIN, "maintd is stopping", self.clock.now())
        logs.get("daemon").warning("rotation.drained", key=STOP_DRAIN, reason="maintd is stopping", wait_seconds=wait)
        self.notifier.status(f"draining for {wait:.0f}s before exit")
        self.clock.wait(cut_short, wait)

    def stop(self, handler_grace: float) -> None:
        """Let handlers finish for `handler_grace` seconds, stop the workers, write the state a last time."""
        self.identity_lookup.stop()
        self.runner.stop(handler_grace)
        self.keeper.stop()
        self.rules.stop()
        if self.history is not None:
            self.history.stop()
        self.coordinator.stop()
        if self.budget is not None:
            self.budget.stop()
        with kept_in_memory():
            self.store.flush()


def make_budget(parts: Parts, carrier: Carrier | None) -> Budget | None:
    """The disruption budget, when the config asks for one (on a backend with a shared store only: refused
    otherwise)."""
    c = parts.config.coordination
    if carrier is None or c.budget is None:
        return None
    from agent.coordination.member_urls import member_url
    from agent.fleet.budget import Budget
    from agent.fleet.budget_wake import WakeSender, advertised, primary_ip

    states = {"ok": HealthState.OK, "warning": HealthState.WARNING}
    return Budget(c.budget, store=carrier.store, describe=carrier.describe, clock=parts.clock,
                  on_change=parts.inbox.coordination_changed, metrics=parts.metrics,
                  health=lambda prop, state, text: parts.health.set("coordination", prop, states[state], text),
                  needs=lambda: preparation_needs(parts.services.settings, parts.config.handlers),
                  lead_time=lambda: lead_seconds(parts.config.prepare.lead_time),
                  wake_sender=None if (wake := c.budget.wake_url) is None else WakeSender(  # B5: hints by name
                      parts.peer_token, parts.metrics, lambda name: member_url(wake, name, parts.identity)),
                  url=advertised(c.budget.advertise, parts.config.server.listen, primary_ip),
                  answers=carrier.answers, rejoin_wait=lambda: rejoin_seconds(parts.config))


def make_api(parts: Parts, view: Callable[[], LoopView]) -> LocalApi:
    """The API facade over the parts it reads and the loop's published view."""
    return LocalApi(view, store=parts.store, health=parts.health, rotation=parts.rotation, readiness=parts.readiness,
                    coordinator=parts.coordinator, preparation=parts.preparation, metrics=parts.metrics,
                    clock=parts.clock, peer_token=parts.peer_token, history=parts.history,
                    history_group=parts.history_group,
                    budget_wake=parts.budget.wake if parts.budget is not None else None)


def serve(parts: Parts, view: Callable[[], LoopView], sock: Any = None) -> tuple[ApiServer, TcpProbe | None]:
    """Start the HTTP server (on a socket-activated `sock` when systemd passed one) and the TCP probe."""
    c = parts.config.server
    server = ApiServer(c.listen, make_api(parts, view), parts.metrics, probe_path=parts.config.probe.path,
                       token_reader=parts.server_token, max_body_bytes=c.max_body_bytes,
                       read_timeout=c.read_timeout, sock=sock, per_client=c.max_connections_per_client,
                       max_connections=c.max_connections, require_token_on_loopback=c.require_token_on_loopback,
                       unix_socket=c.unix_socket, unix_socket_group=c.unix_socket_group)
    server.serve_in_background()
    probe = parts.config.probe
    tcp_probe = None
    if probe.mode == "tcp" and probe.listen:
        tcp_probe = TcpProbe(probe.listen, lambda: parts.rotation.verdict().in_rotation, watch=parts.rotation)
        tcp_probe.start()
    return server, tcp_probe
