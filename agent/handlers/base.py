"""The handler protocol: a class with a config schema (`Options`) and one method per phase.

A handler's methods `scheduled`, `started`, `completed` each take a `Context` and return a
`Result` (None means ok); raising is a failed result, never a crash. Handlers that wait use
`ctx.sleep`, which a stop cuts short. Third-party handlers subclass `Handler` and register
under the `maintd.handlers` entry-point group:

    [project.entry-points."maintd.handlers"]
    pagerduty = "mypkg.pd:PagerDutyHandler"
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from agent.clock import Clock
from agent.events import Event

if TYPE_CHECKING:
    from agent.config import Config
    from agent.health import HealthStore
    from agent.metrics import Metrics
    from agent.rotation import Rotation
    from agent.state import Store

PHASES = ("scheduled", "started", "completed")
OK, FAILED, TIMED_OUT, SKIPPED = "ok", "failed", "timed_out", "skipped"


@dataclass(frozen=True)
class Result:
    """How one handler run ended."""

    outcome: str = OK
    detail: str = ""
    exit_code: int | None = None
    output: str = ""


@dataclass(frozen=True)
class NoOptions:
    """A handler type with no options of its own."""


@dataclass(frozen=True)
class HandlerSpec:
    """One entry of `handlers:` in the config: the common keys plus the type's own `options`."""

    name: str
    type: str
    phases: tuple[str, ...]
    event_types: tuple[str, ...] = ()
    event_sources: tuple[str, ...] = ()
    scope: str = "self"
    timeout: float = 60.0
    on_failure: str = "block"
    order: int = 0
    dry_run: bool = False
    options: Any = field(default_factory=NoOptions)

    def applies_to(self, event: Event, names_self: bool) -> bool:
        """Whether this handler's filters (event_types, event_sources, scope) select the event."""
        if self.event_types and event.event_type not in self.event_types:
            return False
        if self.event_sources and event.source not in self.event_sources:
            return False
        return names_self or self.scope == "any"


@dataclass
class Services:
    """What handlers may use besides the event: the daemon's shared parts."""

    config: "Config"
    clock: Clock
    rotation: "Rotation"
    health: "HealthStore"
    store: "Store"
    metrics: "Metrics"
    vm_name: str | None = None
    profile: Any = None
    """The profile in force (`policy.Profile`): may narrow handlers and override drain timings."""


@dataclass
class Context:
    """Everything one handler run knows: the event, the phase, its time budget."""

    event: Event
    phase: str
    vm_name: str
    names_self: bool
    timeout: float
    deadline: datetime | None
    dry_run: bool
    clock: Clock
    cancel: threading.Event
    outcome: str | None = None
    approved_by: str | None = None

    def sleep(self, seconds: float) -> bool:
        """Wait `seconds`; True when the wait was cut short (maintd is stopping)."""
        return self.clock.wait(self.cancel, seconds)

    def payload(self) -> dict[str, Any]:
        """The event as handlers receive it (stdin JSON, generic webhook body)."""
        return {
            "phase": self.phase,
            "vm_name": self.vm_name,
            "names_this_vm": self.names_self,
            "outcome": self.outcome,
            "dry_run": self.dry_run,
            "event": self.event.to_json(),
        }

    def environment(self) -> dict[str, str]:
        """The event as MAINTD_* environment variables (text only, never interpolated into a shell)."""
        e = self.event
        env = {
            "MAINTD_EVENT_ID": e.event_id,
            "MAINTD_EVENT_TYPE": e.event_type,
            "MAINTD_EVENT_STATUS": e.status,
            "MAINTD_NOT_BEFORE": e.not_before.isoformat().replace("+00:00", "Z") if e.not_before else "",
            "MAINTD_RESOURCES": ",".join(e.resources),
            "MAINTD_PHASE": self.phase,
            "MAINTD_VM_NAME": self.vm_name,
            "MAINTD_DURATION_SECONDS": str(e.duration_seconds),
            "MAINTD_EVENT_SOURCE": e.source,
            "MAINTD_DESCRIPTION": e.description,
            "MAINTD_LIVE_MIGRATION": "1" if e.live_migration else "0",
            "MAINTD_NAMES_THIS_VM": "1" if self.names_self else "0",
            "MAINTD_OUTCOME": self.outcome or "",
            "MAINTD_TIMEOUT_SECONDS": f"{self.timeout:.0f}",
        }
        if self.dry_run:
            env["MAINTD_DRY_RUN"] = "1"
        return env

    def payload_json(self) -> bytes:
        """`payload()` as UTF-8 JSON."""
        return json.dumps(self.payload(), default=str).encode()


class Handler:
    """Base class: subclasses set `type_name`, optionally `Options`, and define phase methods."""

    type_name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    idempotent: ClassVar[bool] = False
    """True when running again after a crash mid-run is harmless (then an interrupted run is retried)."""

    def __init__(self, spec: HandlerSpec, services: Services) -> None:
        self.spec = spec
        self.options = spec.options
        self.services = services

    @classmethod
    def supported_phases(cls) -> tuple[str, ...]:
        """The phases this class has a method for."""
        return tuple(p for p in PHASES if callable(getattr(cls, p, None)))

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The type-specific config keys."""
        return tuple(f.name for f in dataclasses.fields(cls.Options) if "parse" in f.metadata)

    def minimum_timeout(self) -> float:
        """A floor under the configured timeout (a drain needs its whole LB wait)."""
        return 0.0

    def run(self, ctx: Context) -> Result:
        """Dispatch to the phase method; None from it means ok."""
        result = getattr(self, ctx.phase)(ctx)
        return result if isinstance(result, Result) else Result(OK)
