"""What the disruption budget lets preparation do (pure): handed by the loop to preparation as an immutable
value, so the prepare wing needs nothing of coordination's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LeaveGate:
    """Which pending events may leave rotation now. `governed` False: no budget, everything due may go."""

    governed: bool = False
    allowed: frozenset[str] = frozenset()

    def lets(self, event_id: str) -> bool:
        return not self.governed or event_id in self.allowed


NO_BUDGET = LeaveGate()
