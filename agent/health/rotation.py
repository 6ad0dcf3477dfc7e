"""Whether this VM is in the load balancer's rotation, and why not.

Two things take it out: a drain (manual, `maintd drain`, or one per event, by the `drain`
handler), persisted in the state store so it survives restarts and reboots; and the aggregated
health of the SourceIds `probe.fail_on` admits (by default everything but maintd's own `imds`,
`maintenance`, `config` and `state` reports: an IMDS outage must never drain a whole fleet).

A drain takes effect in memory at once, whatever the disk does: on a full or read-only state disk
the store keeps the change and the loop writes it (and reports the disk) when it can.

What follows the verdict without asking it over and over (the TCP probe) subscribes: it hears of
every drain, undrain, reconfiguration and health change, and `recheck_in` says when a health
report's TimeToLive runs out, the one change that comes with time alone.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TypedDict

from agent.errors import kept_in_memory
from agent.health.health_store import HealthState, HealthStore
from agent.model.timefmt import iso_z
from agent.state.state_store import Store

DRAINS_FLAG = "drains"


class Drain(TypedDict):
    """One drain as the state store's `drains` flag keeps it (and /v1/status shows it), by its key."""

    reason: str
    since: str


class OutOfRotation(TypedDict):
    """An event's interval out of rotation, kept in the state store under the event (`OUT_OF_ROTATION`)."""

    out_at: str | None
    back_at: str


MANUAL = "manual"
OUT_OF_ROTATION = "rotation"
"""The state store's record, per event, of when its drain began and was lifted (the fleet history reads it)."""
MAINTENANCE_SOURCES = ("maintenance", "maintd")
"""The SourceIds whose reports are about maintenance itself (the loop's `maintenance/pending`, the `health`
handler's `maintd/maintenance/<EventId>`): never a reason for `/app-health` to say Unhealthy."""
PLATFORM_SOURCES = ("imds",)
"""The SourceIds whose reports are about the platform's endpoint, not the application: IMDS silent or stale
(`imds/poll`), a request it rejected (`imds/request`), this VM's name not learnt (`imds/identity`). Reimaging or
restarting the VM fixes none of them (and a fleet-wide outage would repair every VM at once): never a reason for
`/app-health` to say Unhealthy (decision 0200)."""


def source_filter(patterns: Sequence[str]) -> Callable[[str], bool]:
    """A predicate on SourceIds from `probe.fail_on` patterns: globs, `*` for all, `!glob` excludes (wins)."""
    include = [p for p in patterns if not p.startswith("!")]
    exclude = [p[1:] for p in patterns if p.startswith("!")]

    def matches(source_id: str) -> bool:
        if any(fnmatch.fnmatchcase(source_id, p) for p in exclude):
            return False
        return any(fnmatch.fnmatchcase(source_id, p) for p in include)

    return matches


@dataclass(frozen=True)
class Verdict:
    """What the probe answers: in rotation or not, and the reason shown to people."""

    in_rotation: bool
    reason: str


def verdict(drains: dict[str, Drain], health: HealthState, unhealthy: Sequence[str]) -> Verdict:
    """Pure decision: any drain or an Error health takes the VM out of rotation."""
    if drains:
        reasons = "; ".join(f"{key}: {d.get('reason', '')}".rstrip(": ") for key, d in sorted(drains.items()))
        return Verdict(False, f"draining ({reasons})")
    if health >= HealthState.ERROR:
        return Verdict(False, "unhealthy: " + ("; ".join(unhealthy) or "health is Error"))
    return Verdict(True, "OK")


def app_health(health: HealthState, unhealthy: Sequence[str], drained: bool) -> tuple[bool, str]:
    """Pure decision for `/app-health` (automatic instance repairs): Unhealthy only when health other than
    maintenance's own and the platform's is Error; a drain, for maintenance or by hand, is never a reason to
    repair the VM."""
    if health >= HealthState.ERROR:
        return False, "unhealthy: " + ("; ".join(unhealthy) or "health is Error")
    return True, ("out of rotation (drained), healthy otherwise" if drained else "OK")


class Rotation:
    """Drains by key (`manual`, `event:<EventId>`), persisted; and the probe's current verdict."""

    def __init__(self, store: Store, health: HealthStore, fail_on: Sequence[str],
                 consider_warning_as_error: bool = False) -> None:
        self.store = store
        self.health = health
        self._lock = threading.Lock()
        self._listeners: tuple[Callable[[], None], ...] = ()
        self.configure(fail_on, consider_warning_as_error)

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener` after anything that may change the verdict (it must not block: it runs on the
        changing thread, the loop's or an API worker's)."""
        self._listeners += (listener,)
        self.health.subscribe(listener)

    def recheck_in(self) -> float | None:
        """Seconds until the verdict may change with nobody calling (a health TTL runs out); None: never."""
        return self.health.next_expiry_in()

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def configure(self, fail_on: Sequence[str], consider_warning_as_error: bool) -> None:
        """Apply (new) probe.fail_on and health.consider_warning_as_error."""
        self._sources = source_filter(fail_on)
        self._warning_is_error = consider_warning_as_error
        self._changed()

    def drains(self) -> dict[str, Drain]:
        """Current drains: key -> {"reason", "since"}."""
        return dict(self.store.flag(DRAINS_FLAG) or {})

    def drain(self, key: str, reason: str, now: datetime) -> bool:
        """Take the VM out of rotation for `key`; False if that drain already existed."""
        with self._lock:
            drains = self.drains()
            if key in drains:
                return False
            drains[key] = {"reason": reason, "since": iso_z(now)}
            self._save(drains)
        self._changed()
        return True

    def undrain(self, key: str, event_id: str | None = None, now: datetime | None = None) -> bool:
        """Lift the drain `key`; False if there was none. An event's drain (`event_id`, `now`) leaves its interval
        out of rotation in the state store, under the event (`OUT_OF_ROTATION`: `out_at`, `back_at`)."""
        with self._lock:
            drains = self.drains()
            lifted = drains.pop(key, None)
            if lifted is None:
                return False
            if event_id is not None and now is not None:  # saved with the drains just below
                interval: OutOfRotation = {"out_at": lifted.get("since"), "back_at": iso_z(now)}
                self.store.record(event_id, OUT_OF_ROTATION, interval, wait=False)
            self._save(drains)
        self._changed()
        return True

    def _save(self, drains: dict[str, Drain]) -> None:
        with kept_in_memory():
            self.store.set_flag(DRAINS_FLAG, drains or None)

    @property
    def saved(self) -> bool:
        """Whether the drains (and every other state change) have reached the disk."""
        return not self.store.dirty

    def _health(self, sources: Callable[[str], bool]) -> tuple[HealthState, list[str]]:
        """The aggregated health of the reports `sources` admits, and what makes it so."""
        state = self.health.aggregate(self._warning_is_error, sources)
        unhealthy = [str(u.get("Description", "")) if isinstance(u, dict) else str(u)
                     for u in self.health.unhealthy(self._warning_is_error, sources)]
        return state, unhealthy

    def verdict(self) -> Verdict:
        """What the probe answers now."""
        return verdict(self.drains(), *self._health(self._sources))

    def app_health(self) -> tuple[bool, str]:
        """What `/app-health` answers now: health with the reports about maintenance and the platform left out,
        whatever drains."""
        return app_health(*self._health(_repair_worthy), bool(self.drains()))


def _repair_worthy(source_id: str) -> bool:
    """Whether a report from `source_id` may call for a repair of the VM: not maintenance's, not the platform's."""
    return source_id not in MAINTENANCE_SOURCES and source_id not in PLATFORM_SOURCES
