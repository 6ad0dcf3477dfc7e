"""Building the agent's parts from a `Config`, and rebuilding what a reloaded config changes.

This is the one place that knows which part reads which config section: `Parts` makes them at
start, `Parts.reconfigure` applies a reloaded config to the running parts (what needs a restart is
kept and named), `serve` starts the HTTP server (and the TCP probe) over the API facade. The loop
(`daemon.py`) owns none of this: it only calls the parts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from agent.config import config as config_mod
from agent import logs
from agent.loop.api import LocalApi, LoopView
from agent.clock import Clock
from agent.config.config import Config
from agent.errors import ConfigError, ImdsError, StateError
from agent.coordination.coordinator import Coordinator
from agent.coordination.store_backend import StoreBackend
from agent.handlers.base import Result, Services
from agent.handlers.registry import instantiate
from agent.health.health_store import HealthState, HealthStore
from agent.imds.imds_client import ImdsClient, is_transient
from agent.metrics import Metrics
from agent.windows.approval_policy import Profile
from agent.prepare.preparation import Preparation
from agent.retry import retrying as retrying_on
from agent.health.rotation import Rotation
from agent.health.sampling import RuleEngine
from agent.prepare.handler_runner import Runner, handler_settings
from agent.secretfile import SecretFiles
from agent.http.routes import ApiServer
from agent.state.state_store import Store
from agent.systemd import Notifier, system_is_stopping
from agent.health.tcp_probe import TcpProbe

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
STOP_DRAIN = "stop"
"""The rotation drain key maintd holds while it stops (removed when it starts again)."""
RESTART_ONLY = "server.*, state.dir, coordination.backend, coordination.azure_blob"
"""Keys a reload cannot apply to a running daemon (they take effect after a restart)."""


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    """The kernel's boot id (changes on every boot), or "" where there is none."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Callbacks:
    """How the parts reach back into the loop without importing it."""

    handler_result: Callable[[str, str, str, Result], None]
    coordination_changed: Callable[[], None]


def make_imds_client(config: Config, clock: Clock, metrics: Metrics) -> ImdsClient:
    """The IMDS client for `config.imds`."""
    c = config.imds
    return ImdsClient(c.endpoint, c.api_version, timeout=c.timeout, first_timeout=c.first_timeout,
                      compute_api_version=c.compute_api_version, clock=clock, metrics=metrics)


class Parts:
    """Every part the config asks for, wired to each other and to the loop's callbacks.

    `config` is the config in force; `reconfigure` replaces it (and `imds`, the runner's handlers)
    on reload. Readers on other threads see either the old or the new object, never a mix.
    """

    def __init__(self, config: Config, clock: Clock, callbacks: Callbacks, *, metrics: Metrics | None = None,
                 boot_id: str | None = None,
                 notifier: Notifier | None = None) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.notifier = notifier or Notifier()
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        self.health = HealthStore(clock)
        self.secrets = SecretFiles(self.health)
        s = config.state
        self.store = Store(s.dir, clock, retention=s.retention, journal_max_bytes=s.journal_max_bytes,
                           journal_keep=s.journal_keep)
        self.rotation = Rotation(self.store, self.health, config.probe.fail_on, config.health.consider_warning_as_error)
        self.metrics.follow_verdict(lambda: self.rotation.verdict().in_rotation,
                                    lambda: int(self.health.aggregate(self.config.health.consider_warning_as_error)))
        self.imds = make_imds_client(config, clock, self.metrics)
        self.vm_name: str | None = None if config.identity.name == "auto" else config.identity.name
        self.services = Services(clock=clock, store=self.store, metrics=self.metrics, rotation=self.rotation,
                                 health=self.health)
        self.runner = Runner(instantiate(config.handlers, self.services), self.services, dry_run=config.dry_run,
                             on_result=callbacks.handler_result)
        self.preparation = Preparation(store=self.store, clock=clock, metrics=self.metrics, submit=self.runner.submit,
                                       profiles=config.profiles, prepare=config.prepare)
        self.coordinator = Coordinator(
            config.coordination, approve=lambda ids: self.imds.approve(ids), store=self.store, clock=clock,
            metrics=self.metrics, token_reader=self.peer_token, poll_interval=config.imds.poll_interval,
            on_change=callbacks.coordination_changed, gates=config.gates, local_health=self.health_json,
            warning_as_error=config.health.consider_warning_as_error, health=self.health,
            backend=self._store_backend(callbacks))
        self.rules = RuleEngine(config.health_rules, self.health, clock, self.metrics)

    def _store_backend(self, callbacks: Callbacks) -> StoreBackend | None:
        """The blob store backend, when the config chooses it (the peers otherwise; never both in one run)."""
        c = self.config.coordination
        if c.backend != "azure_blob" or c.azure_blob is None:
            return None
        return StoreBackend(c.azure_blob, token=lambda resource, client_id: self.imds.identity_token(resource, client_id),
                            clock=self.clock, metrics=self.metrics, health=self.health, secret=self.secrets.read,
                            on_change=callbacks.coordination_changed,
                            takeover_after=lambda: self.config.coordination.takeover_after,
                            local_health=self.health_json,
                            warning_as_error=lambda: self.config.health.consider_warning_as_error)

    def peer_token(self) -> str | None:
        """The shared token peers must present on /v1 reads (None: reads are open)."""
        return self.secrets.read("coordination.token_file", self.config.coordination.token_file)

    def server_token(self) -> str | None:
        """The bearer token for mutating endpoints from non-loopback clients."""
        return self.secrets.read("server.token_file", self.config.server.token_file)

    def health_json(self) -> dict[str, Any]:
        """The health store as /v1/health shows it (also what the fleet gate reads of this VM)."""
        return self.health.to_json(self.config.health.consider_warning_as_error)

    def publish_settings(self, profile: Profile | None) -> None:
        """Hand the handlers one immutable snapshot of what they read (name, drain timings, profile)."""
        probe = self.config.probe
        self.services.settings = handler_settings(self.vm_name, probe.lb_timeout, probe.drain_grace, profile)

    def reconfigure(self, new: Config) -> Config:
        """Apply a reloaded config to the running parts; returns the config now in force.

        Every reloadable key takes effect here, from one place; `server.*` and `state.dir` keep
        their running values (logged: they need a restart).
        """
        old = self.config
        c, oc = new.coordination, old.coordination
        if new.server != old.server or new.state.dir != old.state.dir or (c.backend, c.azure_blob) != (
                oc.backend, oc.azure_blob):
            logs.get("daemon").warning("config.needs_restart", keys=RESTART_ONLY,
                                       hint="these take effect after systemctl restart maintd")
            new = replace(new, server=old.server, state=replace(new.state, dir=old.state.dir),
                          coordination=replace(c, backend=oc.backend, azure_blob=oc.azure_blob))
        logs.configure(new.log.format, new.log.level)
        self.store.retention = new.state.retention
        self.rotation.configure(new.probe.fail_on, new.health.consider_warning_as_error)
        if new.imds != old.imds:
            self.imds = make_imds_client(new, self.clock, self.metrics)
        if new.identity != old.identity:
            self.vm_name = None if new.identity.name == "auto" else new.identity.name
        if new.handlers != old.handlers:
            self.runner.handlers = instantiate(new.handlers, self.services)
            for h in self.runner.handlers:
                self.metrics.init_handler(h.spec.name, h.spec.phases)
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


    def resolve_identity(self, attempts: int, cancel: threading.Event) -> str | None:
        """Ask IMDS for this VM's compute identity (tenacity on the injected clock); its name, or None,
        reported, when IMDS cannot tell."""
        retrying = retrying_on(self.clock, retry_if=is_transient, attempts=attempts, cancel=cancel,
                               maximum=min(10.0, self.config.imds.max_backoff))
        log = logs.get("daemon")
        try:
            identity = retrying(self.imds.compute_identity)
        except ImdsError as exc:
            log.error("identity.failed", error=str(exc), body=exc.body[:200] or None,
                      hint="set identity.name in the config if IMDS compute metadata is not available")
            self.health.set("imds", "identity", HealthState.ERROR, f"cannot learn this VM's name from IMDS: {exc}")
            return None
        self.vm_name = name = identity.name
        self.coordinator.identity = identity  # computer name and scale set: how peers are addressed
        log.info("identity.resolved", vm_name=name, computer_name=identity.computer_name or None,
                 scale_set=identity.scale_set or None)
        self.health.set("imds", "identity", HealthState.OK, f"this VM is {name}")
        return name

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

    def drain_for_stop(self, cut_short: threading.Event) -> None:
        """probe.drain_on_stop: leave rotation and wait for the LB to notice before exiting (a role's OnStop)."""
        probe = self.config.probe
        if not (probe.drain_on_stop == "always" or (probe.drain_on_stop == "shutdown" and system_is_stopping())):
            return
        wait = probe.lb_timeout + probe.drain_grace
        self.rotation.drain(STOP_DRAIN, "maintd is stopping", self.clock.now())
        logs.get("daemon").warning("rotation.drained", key=STOP_DRAIN, reason="maintd is stopping", wait_seconds=wait)
        self.notifier.status(f"draining for {wait:.0f}s before exit")
        self.clock.wait(cut_short, wait)

    def stop(self, handler_grace: float) -> None:
        """Let handlers finish for `handler_grace` seconds, stop the workers, write the state a last time."""
        self.runner.stop(handler_grace)
        self.rules.stop()
        self.coordinator.stop()
        try:
            self.store.flush()
        except StateError as exc:
            logs.get("daemon").error("state.write_failed", error=str(exc), at="shutdown")


def make_api(parts: Parts, view: Callable[[], LoopView]) -> LocalApi:
    """The API facade over the parts it reads and the loop's published view."""
    return LocalApi(view, store=parts.store, health=parts.health, rotation=parts.rotation, runner=parts.runner,
                    coordinator=parts.coordinator, preparation=parts.preparation, metrics=parts.metrics,
                    clock=parts.clock, peer_token=parts.peer_token)


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
