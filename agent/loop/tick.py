"""What one loop pass knows, read once by the loop and handed down whole.

The loop builds one `Tick` per pass, once the pass's poll (if one was due) and what it changed are
in: the clock as the loop read it for this pass, the events it tracks, this VM's name and compute
identity, the profile in force, dry-run, and each event's pending handlers (asked of the runner once,
not by a callback from inside the coordinator's loop). The coordinator and the preparation decide on
it and ask neither the clock, the identity nor the runner themselves. It is immutable, so what they
decide on cannot change under them while they decide.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType

from agent.model.identity import Identity
from agent.model.tracker import Tracked
from agent.policy.approval_policy import Profile


@dataclass(frozen=True)
class Tick:
    """One pass: when, the tracked events, this VM, the profile in force, dry-run, each event's pending handlers."""

    now: datetime
    """The loop's wall-clock reading for this pass (plans, due times, records)."""
    monotonic: float
    """The loop's monotonic reading for this pass (the coordinator's retry and gate timings, an order's deadline)."""
    tracked: Mapping[str, Tracked]
    vm_name: str | None
    """This VM's name (None until IMDS or the config told it: nothing is decided about approvals before)."""
    identity: Identity | None
    """This VM's compute identity for addressing peers (None while IMDS has not told it, or the config names the VM)."""
    profile: Profile
    dry_run: bool
    pending: Mapping[str, tuple[str, ...]]
    """Each event naming this VM: the scheduled-phase handlers that keep this VM from being ready for it."""

    @classmethod
    def of(cls, tracked: Mapping[str, Tracked], vm_name: str | None, profile: Profile, dry_run: bool,
           pending: Callable[[Tracked], Sequence[str]], *, now: datetime, monotonic: float,
           identity: Identity | None = None) -> Tick:
        """The pass for `tracked` as it is now, each pending list asked once of `pending` (the runner's)."""
        return cls(now, monotonic, MappingProxyType(dict(tracked)), vm_name, identity, profile, dry_run,
                   MappingProxyType({eid: tuple(pending(t)) for eid, t in tracked.items()
                                     if vm_name is not None and t.event.rank(vm_name) is not None}))

    def pending_for(self, event_id: str) -> list[str]:
        """The event's pending handlers (none for an event not naming this VM)."""
        return list(self.pending.get(event_id, ()))

    def ready(self, event_id: str) -> bool:
        """Whether the event names this VM and no handler of this VM keeps it from being ready for it."""
        return event_id in self.pending and not self.pending[event_id]
