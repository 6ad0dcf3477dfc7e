"""The handler protocol: a class with a config schema (`Options`) and one method per phase.

A handler's methods `scheduled`, `started`, `completed` each take a `Context` and return a
`Result` (None means ok); raising is a failed result, never a crash. Handlers that wait use
`ctx.sleep`, which a stop of maintd or the event leaving the document cuts short. A handler sees
the settings it needs (`Settings`, an immutable snapshot), never the whole config. Third-party
handlers subclass `Handler` and register under the `maintd.handlers` entry-point group:

    [project.entry-points."maintd.handlers"]
    pagerduty = "mypkg.pd:PagerDutyHandler"
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

from agent.clock import Clock
from agent.handlers.spec import HandlerSpec, NoOptions, Result, Settings
from agent.model.events import Event, EventJson
from agent.model.outcomes import CANCELED, FAILED, OK, PHASES, SKIPPED, TIMED_OUT
from agent.model.timefmt import iso_z

if TYPE_CHECKING:
    from agent.health.health_store import HealthStore
    from agent.health.rotation import Rotation
    from agent.state.state_store import Store
    from agent.telemetry.metrics import Metrics

__all__ = ["PHASES", "OK", "FAILED", "TIMED_OUT", "SKIPPED", "CANCELED", "Result", "HandlerSpec", "NoOptions",
           "Settings", "Services", "Context", "Handler"]
"""The plugin API third-party handlers import from here (the pure types live in `agent.handlers.spec`)."""


class Payload(TypedDict):
    """The event as handlers receive it: a hook's stdin JSON, the generic webhook's body."""

    phase: str
    vm_name: str
    names_this_vm: bool
    outcome: str | None
    dry_run: bool
    event: EventJson


@dataclass
class Services:
    """What handlers may use besides the event: the daemon's shared parts and the settings snapshot."""

    clock: Clock
    store: Store
    metrics: Metrics
    rotation: Rotation
    health: HealthStore
    settings: Settings = field(default_factory=Settings)


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
    """Set when the run should end early: maintd is stopping, or the event left the document."""
    stopping: threading.Event = field(default_factory=threading.Event)
    """Set only when maintd is stopping."""
    settings: Settings = field(default_factory=Settings)
    outcome: str | None = None
    approved_by: str | None = None
    attempt: int = 1
    """1, or 2, 3, … when an earlier attempt was cut short by a crash or a stop of maintd."""
    leaving_rotation: bool = False
    """True for a `before_drain` run that the phase's drain follows: the VM leaves rotation for the event as soon
    as this run returns or goes on in the background (work that must be in place by then starts now)."""

    def sleep(self, seconds: float) -> bool:
        """Wait `seconds`; True when the wait was cut short (maintd is stopping or the event is gone)."""
        return self.clock.wait(self.cancel, seconds)

    @property
    def event_gone(self) -> bool:
        """Whether the run was cut short because its event left the document (not by a stop)."""
        return self.cancel.is_set() and not self.stopping.is_set()

    def payload(self) -> Payload:
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
            "MAINTD_NOT_BEFORE": iso_z(e.not_before) if e.not_before else "",
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
            "MAINTD_ATTEMPT": str(self.attempt),
        }
        if self.dry_run:
            env["MAINTD_DRY_RUN"] = "1"
        return env

    def payload_json(self) -> bytes:
        """`payload()` as UTF-8 JSON."""
        return json.dumps(self.payload(), default=str).encode()


NOTE_PREFIX = "note:"
"""A handler's note on an event is stored among the event's results as `note:<handler name>`."""


class Handler:
    """Base class: subclasses set `type_name`, optionally `Options`, and define phase methods."""

    type_name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    defaults: ClassVar[dict[str, Any]] = {}
    """Defaults of common keys that differ for this type (e.g. `{"on_failure": "continue"}`)."""
    leaves_rotation: ClassVar[tuple[str, ...]] = ()
    """The phases in which this type takes the VM out of the load balancer's rotation (the `drain` handler's
    scheduled and started)."""
    before_drain: ClassVar[bool] = False
    """Whether the runner runs this type right before the phase's first handler that takes the VM out of rotation,
    wherever it is listed (its work must be in place when the VM leaves rotation: a silence); in a phase without
    one, at its place in the list."""

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

    def minimum_timeout(self, settings: Settings) -> float:
        """A floor under the configured timeout (a drain needs its whole LB wait)."""
        return 0.0

    def wanted_timeout(self, settings: Settings, configured: float) -> float:
        """What a run needs before NotBefore: a budget NotBefore cuts below it is a `deadline.short`. The
        configured timeout; a handler whose run may last until NotBefore by design (a hold) needs its floor."""
        return configured

    def keep(self) -> float | None:
        """Work that lasts while maintenance lasts (keep a silence or a lease alive), on maintd's keeper
        thread: called when maintd starts, after each run of this handler, and again after the seconds it
        returns; None: nothing to keep until its next run. It shares that thread: keep it short."""
        return None

    def note(self, event_id: str) -> dict[str, Any] | None:
        """This handler's note on the event (small JSON it keeps across restarts; shown in /v1/events/{id})."""
        return self.services.store.result(event_id, NOTE_PREFIX + self.spec.name)

    def set_note(self, event_id: str, note: Mapping[str, Any]) -> None:
        """Keep a note on the event (written through; raises StateError when the disk refuses, kept in memory)."""
        self.services.store.record(event_id, NOTE_PREFIX + self.spec.name, note)

    def notes(self) -> dict[str, dict[str, Any]]:
        """This handler's notes on every stored event (present or gone), by EventId."""
        return self.services.store.records_under(NOTE_PREFIX + self.spec.name)

    def run(self, ctx: Context) -> Result:
        """Dispatch to the phase method; None from it means ok."""
        result = getattr(self, ctx.phase)(ctx)
        return result if isinstance(result, Result) else Result(OK)
