"""Loading maintd's one YAML file into a frozen `Config`, with file:line:col in every error.

The YAML is composed into nodes first so every key keeps its position; duplicate keys are refused
(PyYAML would silently keep the last). Values are then checked section by section (see
`configschema`). `load()` is called at start and on SIGHUP; on reload a refused file leaves the
running config in place (the daemon's job).

Whatever the file holds, the answer is a `Config` or a `ConfigError` naming the file and the fix:
bytes that are not UTF-8, an empty file (a truncated write, not "all defaults": write `{}` for
that), a directory, a dangling symlink, no permission, nesting deeper than `MAX_YAML_DEPTH`
(composing is recursive) and aliases or merge keys that expand past `MAX_YAML_VALUES` (a
"billion laughs" is refused in milliseconds instead of filling memory).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from agent.addressing import template_fields
from agent.configschema import (
    boolean,
    choice,
    duration,
    integer,
    list_of,
    mapping_of,
    opt,
    optional,
    parse_section,
    section,
    text,
)
from agent.coordination_rules import NO_GATES, Gates
from agent.errors import ConfigError, ConfigValueError
from agent.handlers.base import HandlerSpec
from agent.handlers.registry import parse_handlers
from agent.rules import RuleSpec, parse_rules
from agent.policy import (
    DEFAULT_PROFILE,
    NOW,
    LeadTime,
    Profile,
    check_handler_names,
    parse_lead_time,
    parse_lead_times_by_type,
    parse_profiles,
)

Path_ = tuple[str | int, ...]

MAX_CONFIG_BYTES = 1024 * 1024
"""Largest config file read (a config with a hundred handlers is under 50 kB)."""
MAX_YAML_DEPTH = 32
"""Deepest nesting accepted, aliases followed (the deepest real key, a monthly occurrence, is 6)."""
MAX_YAML_VALUES = 20_000
"""Most values (aliases and merge keys expanded) one config may stand for."""


def _is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


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
    warn_after_failures: int = opt(integer(1, 1000), 3, "failed polls in a row before the imds health report turns Warning")
    stale_after: float = opt(duration(1, 86400), 60.0, "no successful poll for this long turns the imds health report Error")
    compute_api_version: str = opt(text(r"^\d{4}-\d{2}-\d{2}$", "a date such as 2021-02-01"), "2021-02-01",
                                   "api-version of the compute metadata call that finds this VM's name")

    def validate(self) -> None:
        if self.poll_interval < 0.2 and not _is_loopback_url(self.endpoint):
            raise ConfigValueError("poll_interval", "below 200ms would exceed IMDS's shared limit of 5 requests/s; "
                                   "only a loopback endpoint (the emulator) may be polled faster")


@dataclasses.dataclass(frozen=True)
class IdentityConfig:
    name: str = opt(text(r"^[^\s]+$", "a VM name without spaces, or auto"), "auto",
                    "this VM's name as it appears in Resources; auto asks IMDS for compute.name")


@dataclasses.dataclass(frozen=True)
class StateConfig:
    dir: str = opt(text(r"^/", "an absolute path"), "/var/lib/maintd",
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
                                 "file holding the bearer token that lets non-loopback clients call mutating endpoints")
    max_body_bytes: int = opt(integer(1024, 16 * 1024 * 1024), 64 * 1024, "largest request body accepted (413 beyond)")
    read_timeout: float = opt(duration(0.1, 300), 5.0,
                              "a request (head and body) must arrive whole within this long, however it trickles; "
                              "an idle keep-alive connection is closed after it")
    max_connections_per_client: int = opt(integer(1, 65536), 32,
                                          "open connections one client address may hold (this host is exempt); more are closed")
    max_connections: int = opt(integer(16, 1_000_000), 4096,
                               "open connections in all; a new one then replaces the oldest idle one from another address")
    require_token_on_loopback: bool = opt(boolean, False,
                                          "mutating endpoints need the server.token_file token from 127.0.0.1 and ::1 too "
                                          "(any local user can reach loopback; maintd's CLI reads the token file itself)")
    unix_socket: str | None = opt(optional(text(r"^/", "an absolute path")), None,
                                  "also serve on this unix socket, such as /run/maintd/maintd.sock (mode 0660): callers are "
                                  "known by uid, root and server.unix_socket_group may read and act; the CLI prefers it")
    unix_socket_group: str | None = opt(optional(text(r"^[a-z_][a-z0-9_-]*\$?$", "a group name")), None,
                                        "group whose members may use server.unix_socket besides root")


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
    drain_grace: float = opt(duration(0, 3600), 10.0, "extra time for in-flight connections after the LB stopped sending new ones")
    drain_on_stop: str = opt(choice("shutdown", "always", "never"), "shutdown",
                             "drain before exiting: when the system shuts down, on every stop, or never")
    fail_on: tuple[str, ...] = opt(list_of(text(), unique=True), ("*", "!imds", "!maintenance", "!config", "!state", "!maintd"),
                                   "SourceIds whose Error takes the VM out of rotation: patterns, * for all, !x excludes x")

    def validate(self) -> None:
        if self.mode == "tcp" and not self.listen:
            raise ConfigValueError("listen", "mode: tcp needs its own port; set probe.listen such as 0.0.0.0:8089")
        if self.lb_interval > self.lb_timeout:
            raise ConfigValueError("lb_interval", "must not exceed probe.lb_timeout (the LB probes at least twice "
                                   "per timeout; Azure's defaults are 15s and 31s)")


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    consider_warning_as_error: bool = opt(boolean, False, "count Warning as Error when aggregating health (probe, fleet gate)")


@dataclasses.dataclass(frozen=True)
class CoordinationConfig:
    peer_url: str = opt(text(r"^https?://\S+$", "a URL template such as http://{computer_name}:8088"),
                        "http://{computer_name}:8088",
                        "how to reach a peer named in Resources: {name}, {computer_name} (derived on a Uniform "
                        "scale set, else the name), {instance_id}")
    peers: dict[str, str] = opt(mapping_of(text(r"^https?://\S+$", "a base URL such as http://10.0.0.5:8088")), {},
                                "static map VM name -> base URL; wins over peers_file and peer_url")
    peers_file: str | None = opt(optional(text(r"^/", "an absolute path")), None,
                                 "YAML/JSON map VM name -> base URL, reread when it changes; wins over peer_url")
    token_file: str | None = opt(optional(text(r"^/", "an absolute path")), None,
                                 "shared bearer token peers send (and this VM requires) on /v1 reads")
    unreachable_peers: str = opt(choice("wait", "ignore"), "wait",
                                 "wait: an unreachable peer blocks approval; ignore: after peer_timeout it no longer does")
    peer_timeout: float = opt(duration(1, 86400), 120.0, "with ignore: how long a peer must be unreachable to be ignored")
    takeover_after: float = opt(duration(1, 86400), 60.0,
                                "a VM approves in the leader's place once every lower-ranked peer is unreachable this long")
    request_timeout: float = opt(duration(0.05, 30), 2.0, "timeout of one peer readiness request")
    max_concurrency: int = opt(integer(1, 256), 16, "peers asked at once (requests to one peer go one after another)")
    peer_recheck_max: float = opt(duration(1, 300), 10.0,
                                  "longest wait before the leader asks a not-ready peer again (ready peers push)")
    approval_retry_for: float = opt(duration(1, 3600), 60.0, "how long one approval POST is retried with backoff")

    def validate(self) -> None:
        try:
            template_fields(self.peer_url)
        except ValueError as exc:
            raise ConfigValueError("peer_url", str(exc)) from None


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """When the scheduled-phase handlers start (see agent.plan): the lead time covers the whole preparation."""

    lead_time: LeadTime = opt(parse_lead_time, NOW,
                              "prepare this long before NotBefore (or before a window that allows approval "
                              "opens); now = at first sight; at most 7d")
    lead_time_by_type: dict[str, LeadTime] = opt(parse_lead_times_by_type, {},
                                                 "per EventType lead time, e.g. {Reboot: 10m, Preempt: now}; "
                                                 "wins over profiles[].lead_time and lead_time")


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
    gates: Gates = opt(section(Gates), NO_GATES, "approval gates: fleet health and Prometheus alerts (see Approval gates)")
    prepare: PrepareConfig = opt(section(PrepareConfig), PrepareConfig(), "")
    dry_run: bool = opt(boolean, False, "run the whole pipeline but send no approval; hooks run only if they opt in")
    source: str = dataclasses.field(default="<defaults>", compare=False)

    def validate(self) -> None:
        try:
            check_handler_names(self.profiles, {h.name for h in self.handlers})
        except ConfigValueError as exc:
            raise exc.under("profiles") from None


# --- YAML with marks -------------------------------------------------------------------------

class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses deep nesting while composing and merge keys that expand too far."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _too_deep(self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Count what `<<` merges would copy (merged maps flattened first, depth-bounded) before copying it."""
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _too_deep(node.start_mark)
            total = len(node.value)
            for key_node, value_node in node.value:
                if key_node.tag != "tag:yaml.org,2002:merge":
                    continue
                for sub in value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]:
                    if isinstance(sub, yaml.MappingNode):
                        self.flatten_mapping(sub)
                        total += len(sub.value)
            if total > MAX_YAML_VALUES:
                raise _too_many(node.start_mark)
            super().flatten_mapping(node)
        finally:
            self.depth -= 1


def _too_deep(mark: yaml.Mark) -> _PositionedError:
    return _PositionedError(mark.line + 1, mark.column + 1, "", f"nested more than {MAX_YAML_DEPTH} levels deep "
                            "(aliases followed); flatten the structure")


def _too_many(mark: yaml.Mark) -> _PositionedError:
    return _PositionedError(mark.line + 1, mark.column + 1, "", f"stands for more than {MAX_YAML_VALUES} values "
                            "once aliases and merge keys are expanded; write the values out or use fewer aliases")


class _MarkedValues:
    """Plain Python values from a YAML node tree, plus the (line, column) of every path in it."""

    def __init__(self, loader: _BoundedLoader) -> None:
        self.loader = loader
        self.marks: dict[Path_, tuple[int, int]] = {}
        self.values = 0

    def build(self, node: yaml.Node, path: Path_) -> Any:
        self.values += 1
        if self.values > MAX_YAML_VALUES:
            raise _too_many(node.start_mark)
        if len(path) > MAX_YAML_DEPTH:  # an alias to an enclosing node makes a cycle
            raise _too_deep(node.start_mark)
        self.marks.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        if isinstance(node, yaml.MappingNode):
            self.loader.flatten_mapping(node)
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = self._construct(key_node, path) if isinstance(key_node, yaml.ScalarNode) else None
                if not isinstance(key, (str, int, float, bool)) or key is None:
                    raise ConfigValueError(_fmt_path(path), "keys must be plain text")
                if key in out:
                    line = key_node.start_mark.line + 1
                    first = self.marks.get(path + (str(key),), (None, None))[0]
                    raise _PositionedError(line, key_node.start_mark.column + 1, _fmt_path(path + (str(key),)),
                                           f"duplicate key (first given on line {first}); keep only one")
                self.marks[path + (str(key),)] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                out[str(key) if isinstance(key, str) else key] = self.build(value_node, path + (str(key),))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        return self._construct(node, path)

    def _construct(self, node: yaml.Node, path: Path_) -> Any:
        try:
            return self.loader.construct_object(node, deep=True)
        except (ValueError, OverflowError) as exc:  # e.g. a date that does not exist: 2026-13-01
            raise _PositionedError(node.start_mark.line + 1, node.start_mark.column + 1, _fmt_path(path),
                                   f"cannot be read as a value: {exc}") from None


class _PositionedError(Exception):
    def __init__(self, line: int, column: int, key: str, message: str) -> None:
        super().__init__(message)
        self.line, self.column, self.key, self.message = line, column, key, message


def _fmt_path(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _parse_key(key: str) -> Path_:
    parts: list[str | int] = []
    for dotted in key.split("."):
        while dotted:
            if dotted.startswith("["):
                end = dotted.index("]")
                parts.append(int(dotted[1:end]))
                dotted = dotted[end + 1:]
            else:
                name, _, rest = dotted.partition("[")
                parts.append(name)
                dotted = "[" + rest if rest else ""
    return tuple(parts)


def _mark_for(marks: dict[Path_, tuple[int, int]], key: str) -> tuple[int | None, int | None]:
    try:
        path = _parse_key(key) if key else ()
    except ValueError:  # a key whose own name holds "[" (found by fuzzing): the document's position
        path = ()
    while True:
        if path in marks:
            return marks[path]
        if not path:
            return None, None
        path = path[:-1]


def check_permissions(path: Path, st: os.stat_result | None = None) -> None:
    """Refuse a config file others could write to: hooks in it run as maintd's user."""
    st = st or path.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(str(path), None, None, "", f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                          f"hooks in it run as maintd's user. Fix: chmod go-w {path}")
    if st.st_uid not in (0, os.geteuid()):
        raise ConfigError(str(path), None, None, "", f"is owned by uid {st.st_uid}, neither root nor maintd's user; "
                          f"fix: chown root {path}")


def loads(text_: str, source: str = "<string>") -> Config:
    """Parse and validate config text; raise ConfigError naming source, line, column and key."""
    try:
        loader = _BoundedLoader(text_)
    except yaml.YAMLError as exc:  # the reader refuses control characters before parsing starts
        raise ConfigError(source, None, None, "", f"not valid YAML: {exc}") from None
    try:
        node = loader.get_single_node()
        values = _MarkedValues(loader)
        data = values.build(node, ()) if node is not None else {}
    except _PositionedError as exc:
        raise ConfigError(source, exc.line, exc.column, exc.key, exc.message) from None
    except ConfigValueError as exc:
        line, col = _mark_for(values.marks, exc.key)
        raise ConfigError(source, line, col, exc.key, exc.message) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise ConfigError(source, line, col, "", f"not valid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, None, None, "", f"not valid YAML: {exc}") from None
    except RecursionError:  # unreachable with the depth bounds above; kept so no caller ever sees it
        raise ConfigError(source, None, None, "", f"nested too deeply (more than {MAX_YAML_DEPTH} levels)") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, 1, 1, "", "the top level must be a mapping of sections (imds:, state:, ...)")
    try:
        config = parse_section(Config, data)
    except ConfigValueError as exc:
        line, col = _mark_for(values.marks, exc.key)
        raise ConfigError(source, line, col, exc.key, exc.message) from None
    return dataclasses.replace(config, source=source)


def load(path: str | os.PathLike[str], check_perms: bool = True) -> Config:
    """Read, check the permissions of, and validate the config file at `path`."""
    p = Path(path)
    raw = _read(p, check_perms)
    try:
        text_ = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), None, None, "", f"is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                          "a damaged file or another encoding: restore it or save it as UTF-8") from None
    if not text_.strip():
        raise ConfigError(str(p), None, None, "", "is empty (a truncated write?); restore it, or write {} "
                          "to run with every default")
    return loads(text_, str(p))


def _read(p: Path, check_perms: bool) -> bytes:
    """The bytes of the config file; every way of not being a readable file is a ConfigError with the fix."""
    def refuse(message: str) -> ConfigError:
        return ConfigError(str(p), None, None, "", message)

    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if p.is_symlink():
            raise refuse(f"is a symbolic link to {os.readlink(p)}, which does not exist; fix the link or pass "
                         "--config") from None
        raise refuse("no such file; create it (see config/maintd.yaml) or pass --config") from None
    except PermissionError:
        raise refuse(f"cannot be read by maintd's user (uid {os.geteuid()}): permission denied; fix: "
                     f"chown root {p} and run maintd as root, or make it readable (not writable) by maintd's user") from None
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise refuse("is a directory; pass the config file itself (such as /etc/maintd/maintd.yaml)")
        if not stat.S_ISREG(st.st_mode):
            raise refuse("is not a regular file; pass the config file itself")
        if check_perms:
            check_permissions(p, st)
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
        while len(data) <= MAX_CONFIG_BYTES and (chunk := os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))):
            data += chunk
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise refuse(f"is larger than {MAX_CONFIG_BYTES} bytes; a config is a few kilobytes: is this the right file?")
    return data
