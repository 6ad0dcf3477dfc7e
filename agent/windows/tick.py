"""What one coordination pass knows, computed once by the loop and handed down whole.

The loop builds a `Tick` right after a successful poll: the events it tracks, this VM's name, the
profile in force, dry-run, and each event's pending handlers (asked of the runner once, not by a
callback from inside the coordinator's loop). It is immutable, so what the coordinator decides on
cannot change under it while it decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from agent.model.tracker import Tracked
from agent.windows.approval_policy import Profile


@dataclass(frozen=True)
class Tick:
    """One pass: the tracked events, this VM, the profile in force, dry-run, each event's pending handlers."""

    tracked: Mapping[str, Tracked]
    vm_name: str
    profile: Profile
    dry_run: bool
    pending: Mapping[str, tuple[str, ...]]
    """Each event naming this VM: the scheduled-phase handlers that keep this VM from being ready for it."""

    @classmethod
    def of(cls, tracked: Mapping[str, Tracked], vm_name: str, profile: Profile, dry_run: bool,
           pending: Callable[[Tracked], Sequence[str]]) -> Tick:
        """The pass for `tracked` as it is now, each pending list asked once of `pending` (the runner's)."""
        return cls(MappingProxyType(dict(tracked)), vm_name, profile, dry_run,
                   MappingProxyType({eid: tuple(pending(t)) for eid, t in tracked.items()
                                     if t.event.rank(vm_name) is not None}))

    def pending_for(self, event_id: str) -> list[str]:
        """The event's pending handlers (none for an event not naming this VM)."""
        return list(self.pending.get(event_id, ()))
