"""Handler types by name: the built-ins plus plugins from the `maintd.handlers` entry-point group,
and parsing of the config's `handlers:` list into `HandlerSpec`s."""

from __future__ import annotations

import dataclasses
from typing import Any

from agent.errors import ConfigValueError
from agent.handlers.base import PHASES, Handler, HandlerSpec, Services
from agent.model.config_schema import (
    boolean,
    choice,
    did_you_mean,
    duration,
    integer,
    list_of,
    named_list,
    opt,
    parse_section,
    text,
)
from agent.model.events import KNOWN_TYPES

ENTRY_POINT_GROUP = "maintd.handlers"


BUILTIN_TYPES = ("drain", "exec", "webhook", "health", "alertmanager", "pacemaker")


def _builtin(name: str) -> type[Handler] | None:
    """The built-in handler class `name`, importing only its module: webhook and health bring an HTTP
    client (requests) that a config with only drain and exec handlers need not load."""
    if name == "drain":
        from agent.handlers.drain import DrainHandler
        return DrainHandler
    if name == "exec":
        from agent.handlers.exec import ExecHandler
        return ExecHandler
    if name == "webhook":
        from agent.handlers.webhook import WebhookHandler
        return WebhookHandler
    if name == "health":
        from agent.handlers.health_report import HealthHandler
        return HealthHandler
    if name == "alertmanager":
        from agent.handlers.alertmanager import AlertmanagerHandler
        return AlertmanagerHandler
    if name == "pacemaker":
        from agent.handlers.pacemaker import PacemakerHandler
        return PacemakerHandler
    return None


def builtin_types() -> dict[str, type[Handler]]:
    return {name: cls for name in BUILTIN_TYPES if (cls := _builtin(name)) is not None}


def plugins() -> dict[str, type[Handler]]:
    """Handler types from the `maintd.handlers` entry-point group; a name given twice is an error.

    Only called for a type that is not built in: scanning every installed distribution's metadata
    costs several MB of memory that a config using built-ins need not pay.
    """
    from importlib.metadata import entry_points

    found: dict[str, type[Handler]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN_TYPES or ep.name in found:
            raise ConfigValueError("", f"handler type {ep.name!r} is provided twice (plugin {ep.value}); "
                                   "uninstall one of the packages")
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin must say so, not crash the daemon
            raise ConfigValueError("", f"handler plugin {ep.name!r} ({ep.value}) cannot be loaded: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, Handler)):
            raise ConfigValueError("", f"handler plugin {ep.name!r} ({ep.value}) is not a maintd Handler class")
        found[ep.name] = cls
    return found


def handler_type(name: Any) -> type[Handler] | None:
    """The class for a handler type name: a built-in, else a plugin, else None."""
    if not isinstance(name, str):
        return None
    return _builtin(name) or plugins().get(name)


def available() -> dict[str, type[Handler]]:
    """Every handler type: built-ins, then plugins."""
    return {**builtin_types(), **plugins()}


@dataclasses.dataclass(frozen=True)
class CommonKeys:
    name: str = opt(text(r"^[A-Za-z0-9_.-]{1,64}$", "letters, digits, _ . - (up to 64)"), doc="unique handler name")
    type: str = opt(text(), doc="handler type (drain, exec, webhook, health, alertmanager, pacemaker, or a plugin)")
    phases: tuple[str, ...] = opt(list_of(choice(*PHASES), min_len=1, unique=True), doc="phases it runs in")
    event_types: tuple[str, ...] = opt(list_of(text(), unique=True), (), "only these EventTypes (default all)")
    event_sources: tuple[str, ...] = opt(list_of(choice("Platform", "User"), unique=True), (),
                                         "only these EventSources (default both)")
    scope: str = opt(choice("self", "any"), "self", "self: events naming this VM; any: every event in the document")
    timeout: float = opt(duration(0.1, 86400), 60.0, "longest run; capped by the time left before NotBefore")
    on_failure: str = opt(choice("block", "continue"), "block",
                          "block: the VM is not ready and approval waits; continue: failure still counts as ready, "
                          "and the phase waits for its first 3 s only (the run goes on in the background)")
    order: int = opt(integer(-1000, 1000), 0, "runs in ascending order within a phase (then list order)")
    dry_run: bool = opt(boolean, False, "also run when maintd is in dry-run mode (gets MAINTD_DRY_RUN=1)")
    rerun_interrupted: bool = opt(boolean, True,
                                  "run again after a crash or stop of maintd cut a run short (with MAINTD_ATTEMPT=2, "
                                  "3, ...); false: at most once, an interrupted run is recorded failed")
    max_attempts: int = opt(integer(1, 10), 3, "most runs of one phase when crashes keep interrupting it")


COMMON_KEYS = tuple(f.name for f in dataclasses.fields(CommonKeys))


def _parse_one(item: Any) -> HandlerSpec:
    if not isinstance(item, dict):
        raise ConfigValueError("", "each handler is a mapping with name, type and phases")
    kind = item.get("type")
    cls = handler_type(kind)
    if cls is None:
        types = available()
        raise ConfigValueError("type" if "type" in item else "", f"unknown handler type {kind!r}"
                               f"{did_you_mean(str(kind), types)}; "
                               f"available: {', '.join(sorted(types))}")
    option_keys = cls.option_names()
    for key in item:
        if key not in COMMON_KEYS and key not in option_keys:
            known = sorted(COMMON_KEYS + option_keys)
            raise ConfigValueError(str(key), f"unknown key for a {kind} handler{did_you_mean(str(key), known)}; "
                                   f"known keys: {', '.join(known)}")
    common = parse_section(CommonKeys, {**cls.defaults, **{k: v for k, v in item.items() if k in COMMON_KEYS}})
    options: Any = parse_section(cls.Options, {k: v for k, v in item.items() if k in option_keys})
    unsupported = [p for p in common.phases if p not in cls.supported_phases()]
    if unsupported:
        raise ConfigValueError("phases", f"a {kind} handler has no {', '.join(unsupported)} phase; "
                               f"it supports {', '.join(cls.supported_phases())}")
    for i, t in enumerate(common.event_types):
        if t not in KNOWN_TYPES:
            hint = did_you_mean(t, KNOWN_TYPES)
            if hint:
                raise ConfigValueError(f"event_types[{i}]", f"{t!r} is not an EventType{hint}")
    return HandlerSpec(options=options, **dataclasses.asdict(common))


def parse_handlers(value: Any) -> tuple[HandlerSpec, ...]:
    """The `handlers:` list, each entry checked against its type's schema; names must be unique."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigValueError("", "handlers is a list of mappings (- name: ..., type: ..., phases: [...])")
    return named_list(value, _parse_one, "handler")


def instantiate(specs: tuple[HandlerSpec, ...], services: Services) -> list[Handler]:
    """Handler objects for the specs, sorted by `order` then list position."""
    ordered = sorted(enumerate(specs), key=lambda pair: (pair[1].order, pair[0]))
    return [_type_of(spec.type)(spec, services) for _, spec in ordered]


def _type_of(name: str) -> type[Handler]:
    cls = handler_type(name)
    if cls is None:  # a plugin uninstalled since the config was parsed
        raise ConfigValueError("type", f"handler type {name!r} is no longer installed")
    return cls
