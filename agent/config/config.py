"""maintd's one YAML file as a frozen `Config`, with file:line:col in every error.

`agent.config.config_loading` reads the file and its YAML (every value keeps its position); the values are
then checked section by section (see `configschema`). `load()` is called at start and on SIGHUP;
on reload a refused file leaves the running config in place (the daemon's job). Whatever the file
holds, the answer is a `Config` or a `ConfigError` naming the file and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from agent.config.config_advice import unprepared_early_approvals
from agent.config.config_loading import Marked, parse_yaml, read_text
from agent.coordination import backend_registry
from agent.coordination.coordination_settings import CoordinationConfig
from agent.errors import ConfigError, ConfigValueError
from agent.handlers.base import HandlerSpec
from agent.handlers.registry import parse_handlers
from agent.health.health_rules import RuleSpec, parse_rules
from agent.model.config_schema import (
    boolean,
    choice,
    duration,
    integer,
    list_of,
    opt,
    optional,
    parse_section,
    section,
    text,
)
from agent.model.gate_specs import NO_GATES, Gates
from agent.net.addresses import is_loopback_url
from agent.policy.approval_policy import (
    DEFAULT_PROFILE,
    Profile,
    check_handler_names,
    parse_profiles,
)
from agent.prepare.prepare_plan import PrepareConfig

DEFAULT_PATH = "/etc/maintd/maintd.yaml"
DEFAULT_STATE_DIR = "/var/lib/maintd"
DEFAULT_UNIX_SOCKET = "/run/maintd/maintd.sock"
"""systemd creates /run/maintd for the unit (RuntimeDirectory=maintd)."""
MAX_SOCKET_PATH = 107
"""sun_path holds 108 bytes with the terminating NUL."""



@dataclasses.dataclass(frozen=True)
class ImdsConfig:
    endpoint: str = opt(text(r"^https?://[^/\s]+$", "a base URL such as http://169.254.169.254 (no path)"),
                        "http://169.254.169.254", "IMDS base URL; only the emulator or a test changes it")
    api_version: str = opt(text(r"^\d{4}-\d{2}-\d{2}$", "a date such as 2020-07-01"), "2020-07-01",
                           "Scheduled Events api-version; 2020-07-01 is the newest documented one")
    poll_interval: float = opt(duration(0.001, 60), 1.0, "time between two polls")
    timeout: float = opt(duration(0.05, 120), 5.0, "timeout of one steady-state poll")
    first_timeout: float = opt(duration(0.05, 600), 120.0,
                               "timeout of the very first poll (IMDS may take up to 2 minutes after enabling)")
    max_backoff: float = opt(duration(0.001, 3600), 10.0, "longest wait between polls while IMDS fails")
    warn_after_failures: int = opt(integer(1, 1000), 3,
                                   "failed polls in a row before the imds health report turns Warning")
    stale_after: float = opt(duration(1, 86400), 60.0,
                             "no successful poll for this long turns the imds health report Error")
    compute_api_version: str = opt(text(r"^\d{4}-\d{2}-\d{2}$", "a date such as 2021-02-01"), "2021-02-01",
                                   "api-version of the compute metadata call that finds this VM's name")

    def validate(self) -> None:
        if self.poll_interval < 0.2 and not is_loopback_url(self.endpoint):
            raise ConfigValueError("poll_interval", "below 200ms would exceed IMDS's shared limit of 5 requests/s; "
                                   "only a loopback endpoint (the emulator) may be polled faster")


@dataclasses.dataclass(frozen=True)
class IdentityConfig:
    name: str = opt(text(r"^[^\s]+$", "a VM name without spaces, or auto"), "auto",
                    "this VM's name as it appears in Resources; auto asks IMDS for compute.name")


@dataclasses.dataclass(frozen=True)
class StateConfig:
    dir: str = opt(text(r"^/", "an absolute path"), DEFAULT_STATE_DIR,
                   "where the state file and the audit journal live ($STATE_DIRECTORY under systemd)")
    retention: float = opt(duration(60), 7 * 86400.0, "how long a finished event stays in the state file")
    journal_max_bytes: int = opt(integer(4096), 10 * 1024 * 1024, "size at which the audit journal is rotated")
    journal_keep: int = opt(integer(1, 100), 5, "rotated audit journal files kept")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    format: str = opt(choice("auto", "json", "console"), "auto", "json lines, console, or auto (console on a TTY)")
    level: str = opt(choice("debug", "info", "warning", "error"), "info", "lowest level logged")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    listen: str = opt(text(r"^(\[[0-9a-fA-F:]+\]|[^:\s]+):\d{1,5}$", "host:port such as 0.0.0.0:8088"),
                      "0.0.0.0:8088", "address of the HTTP server (probe, /healthz, /metrics, /v1 API)")
    token_file: str | None = opt(optional(text(r"^/", "an absolute path")), None,
                                 "file holding the bearer token that lets TCP clients (other hosts, and 127.0.0.1 "
                                 "under require_token_on_loopback) call mutating endpoints")
    max_body_bytes: int = opt(integer(1024, 16 * 1024 * 1024), 64 * 1024, "largest request body accepted (413 beyond)")
    read_timeout: float = opt(duration(0.1, 300), 5.0,
                              "a request (head and body) must arrive whole within this long, however it trickles; "
                              "an idle keep-alive connection is closed after it")
    max_connections_per_client: int = opt(integer(1, 65536), 32,
                                          "open connections one client address may hold (from 127.0.0.1 or "
                                          "::1, one local user, by uid); more are closed")
    max_connections: int = opt(integer(16, 1_000_000), 4096,
                               "open connections in all; a new one then replaces an idle one of the client "
                               "holding the most")
    require_token_on_loopback: bool = opt(boolean, True,
                                          "mutating endpoints over TCP need the server.token_file token from 127.0.0.1 "
                                          "and ::1 too, since any local user can reach loopback (root's CLI uses the "
                                          "unix socket); false lets every local user drain and approve")
    unix_socket: str | None = opt(optional(text(r"^/", "an absolute path")), DEFAULT_UNIX_SOCKET,
                                  "also serve on this unix socket (mode 0660): callers are known by uid (SO_PEERCRED); "
                                  "root, maintd's own user and server.unix_socket_group may read and act; the CLI "
                                  "uses it first; null: none")
    unix_socket_group: str | None = opt(optional(text(r"^[a-z_][a-z0-9_-]*\$?$", "a group name")), None,
                                        "group whose members may use server.unix_socket besides root and maintd's user")

    def validate(self) -> None:
        if self.unix_socket and len(os.fsencode(self.unix_socket)) > MAX_SOCKET_PATH:
            raise ConfigValueError("unix_socket", f"a unix socket's path is at most {MAX_SOCKET_PATH} bytes; "
                                   "choose a shorter one such as /run/maintd/maintd.sock")


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    path: str = opt(text(r"^/[^\s?#]*$", "an absolute URL path such as /probe"), "/probe",
                    "path of the load balancer's HTTP probe on the server")
    mode: str = opt(choice("http", "tcp"), "http",
                    "http: 200/503 on path; tcp: a port that stops accepting connections while out of rotation")
    listen: str | None = opt(optional(text(r"^(\[[0-9a-fA-F:]+\]|[^:\s]+):\d{1,5}$", "host:port")), None,
                             "address of the TCP probe port (mode: tcp only)")
    lb_timeout: float = opt(duration(11, 3600), 31.0,
                            "the load balancer's probe timeout: how long it may take to notice a failing probe")
    lb_interval: float = opt(duration(5, 3600), 15.0, "the load balancer's probe interval")
    drain_grace: float = opt(duration(0, 3600), 10.0,
                             "extra time for in-flight connections after the LB stopped sending new ones")
    drain_on_stop: str = opt(choice("shutdown", "always", "never"), "shutdown",
                             "drain before exiting: when the system shuts down, on every stop, or never")
    fail_on: tuple[str, ...] = opt(list_of(text(), unique=True),
                                   ("*", "!imds", "!maintenance", "!config", "!state", "!maintd"),
                                   "SourceIds whose Error takes the VM out of rotation: patterns, * for all, "
                                   "!x excludes x")

    def validate(self) -> None:
        if self.mode == "tcp" and not self.listen:
            raise ConfigValueError("listen", "mode: tcp needs its own port; set probe.listen such as 0.0.0.0:8089")
        if self.lb_interval > self.lb_timeout:
            raise ConfigValueError("lb_interval", "must not exceed probe.lb_timeout (the LB probes at least twice "
                                   "per timeout; Azure's defaults are 15s and 31s)")


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    consider_warning_as_error: bool = opt(boolean, False,
                                          "count Warning as Error when aggregating health (probe, fleet gate)")


@dataclasses.dataclass(frozen=True)
class Config:
    imds: ImdsConfig = opt(section(ImdsConfig), ImdsConfig(), "")
    identity: IdentityConfig = opt(section(IdentityConfig), IdentityConfig(), "")
    state: StateConfig = opt(section(StateConfig), StateConfig(), "")
    log: LogConfig = opt(section(LogConfig), LogConfig(), "")
    server: ServerConfig = opt(section(ServerConfig), ServerConfig(), "")
    probe: ProbeConfig = opt(section(ProbeConfig), ProbeConfig(), "")
    health: HealthConfig = opt(section(HealthConfig), HealthConfig(), "")
    coordination: CoordinationConfig = opt(section(CoordinationConfig), CoordinationConfig(), "")
    handlers: tuple[HandlerSpec, ...] = opt(parse_handlers, (), "what runs in each phase (see Handlers)")
    profiles: tuple[Profile, ...] = opt(parse_profiles, (DEFAULT_PROFILE,), "approval profiles (see Profiles)")
    health_rules: tuple[RuleSpec, ...] = opt(parse_rules, (), "health rules on local metrics (see Health rules)")
    gates: Gates = opt(section(Gates), NO_GATES,
                       "approval gates: fleet health and Prometheus alerts (see Approval gates)")
    prepare: PrepareConfig = opt(section(PrepareConfig), PrepareConfig(), "")
    dry_run: bool = opt(boolean, False, "run the whole pipeline but send no approval; hooks run only if they opt in")
    source: str = dataclasses.field(default="<defaults>", compare=False)

    def validate(self) -> None:
        try:
            check_handler_names(self.profiles, {h.name for h in self.handlers})
        except ConfigValueError as exc:
            raise exc.under("profiles") from None
        try:
            backend_registry.check(self.coordination)
        except ConfigValueError as exc:
            raise exc.under("coordination") from None


def loads(text_: str, source: str = "<string>") -> Config:
    """Parse and validate config text; raise ConfigError naming source, line, column and key."""
    return _parsed(text_, source)[0]


def _parsed(text_: str, source: str) -> tuple[Config, Marked]:
    doc = parse_yaml(text_, source)
    if not isinstance(doc.data, dict):
        raise ConfigError(source, 1, 1, "", "the top level must be a mapping of sections (imds:, state:, ...)")
    try:
        config = parse_section(Config, doc.data)
    except ConfigValueError as exc:
        raise doc.error(exc) from None
    return dataclasses.replace(config, source=source), doc


def load_checked(path: str | os.PathLike[str]) -> tuple[Config, list[str]]:
    """`load`, and what `maintd check-config` warns about in the config it accepts: one line each, at its
    file:line:column (`agent.config.config_advice`)."""
    config, doc = _parsed(read_text(path, True), str(Path(path)))
    advice = unprepared_early_approvals(config.profiles, config.handlers, profiles_given="profiles" in doc.data)
    return config, [f"{doc.where(key)}: {key}: {message}" for key, message in advice]


def load(path: str | os.PathLike[str], check_perms: bool = True) -> Config:
    """Read, check the permissions of, and validate the config file at `path`."""
    return loads(read_text(path, check_perms), str(Path(path)))


def path_from(given: str | None) -> str:
    """The config file to read: `given` (--config), else $MAINTD_CONFIG, else DEFAULT_PATH."""
    return given or os.environ.get("MAINTD_CONFIG") or DEFAULT_PATH


def with_state_env(cfg: Config) -> Config:
    """Use systemd's $STATE_DIRECTORY when state.dir is left at its default."""
    state_env = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if state_env and cfg.state.dir == DEFAULT_STATE_DIR:
        cfg = dataclasses.replace(cfg, state=dataclasses.replace(cfg.state, dir=state_env))
    return cfg
