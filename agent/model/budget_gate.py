"""What the disruption budget lets preparation do (pure): handed by the loop to preparation as an immutable
value, so the prepare wing needs nothing of coordination's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LeaveGate:
    """Which pending events may leave rotation now, and which must return to it. `governed` False: no budget,
    everything due may go. `revoked`: events whose place was lost (B2): a preparation under way for one returns the
    VM to rotation as after a cancel and holds the event again, to be prepared anew once it may leave."""

    governed: bool = False
    allowed: frozenset[str] = frozenset()
    revoked: frozenset[str] = frozenset()

    def lets(self, event_id: str) -> bool:
        return not self.governed or (event_id in self.allowed and event_id not in self.revoked)


NO_BUDGET = LeaveGate()
