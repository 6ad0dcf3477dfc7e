"""The pure side of the handler protocol: one configured handler (`HandlerSpec`), the settings
snapshot a run reads (`Settings`) and how a run ended (`Result`). The decision modules (run records,
the runner's rules) import these without the threads and clocks of `agent.handlers.base`, which
re-exports them for plugins."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.model.events import Event
from agent.model.outcomes import OK


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
    rerun_interrupted: bool = True
    max_attempts: int = 3
    options: Any = field(default_factory=NoOptions)

    def applies_to(self, event: Event, names_self: bool) -> bool:
        """Whether this handler's filters (event_types, event_sources, scope) select the event."""
        if self.event_types and event.event_type not in self.event_types:
            return False
        if self.event_sources and event.source not in self.event_sources:
            return False
        return names_self or self.scope == "any"


class ProfileOverrides(Protocol):
    """What a profile (`agent.policy.approval_policy.Profile`) overrides of the handlers' settings."""

    @property
    def lb_timeout(self) -> float | None: ...
    @property
    def drain_grace(self) -> float | None: ...
    @property
    def handlers(self) -> tuple[str, ...] | None: ...


@dataclass(frozen=True)
class Settings:
    """The settings handlers read, as one immutable snapshot: the loop replaces it whole (reload,
    profile change, name learned), and each run reads the one in force when it starts."""

    vm_name: str = ""
    lb_timeout: float = 31.0
    """Seconds the load balancer may take to notice a failing probe (`probe.lb_timeout`, or the profile's)."""
    drain_grace: float = 10.0
    """Seconds in-flight connections get after that (`probe.drain_grace`, or the profile's)."""
    handlers: tuple[str, ...] | None = None
    """Only these handlers run (the profile in force narrows them); None: all."""
    computer_name: str = ""
    """This VM's computer name (IMDS osProfile.computerName) once learned; "" when unknown."""

    @classmethod
    def for_profile(cls, vm_name: str | None, lb_timeout: float, drain_grace: float, profile: ProfileOverrides | None,
                    computer_name: str = "") -> Settings:
        """The snapshot for the profile in force: this VM's names, the drain timings (the profile's override
        the probe's) and the handlers the profile lets run."""
        if profile is None:
            return cls(vm_name or "", lb_timeout, drain_grace, computer_name=computer_name)
        return cls(vm_name or "", profile.lb_timeout if profile.lb_timeout is not None else lb_timeout,
                   profile.drain_grace if profile.drain_grace is not None else drain_grace, profile.handlers,
                   computer_name)

    @property
    def drain_wait(self) -> float:
        """How long a drain waits: the LB may take its whole probe timeout to stop sending new
        connections, then in-flight ones get the grace (the one rule for the `drain` handler and the
        stop-time drain, with the profile's overrides)."""
        return self.lb_timeout + self.drain_grace
