"""The fleet safety wing's words, defined once: where this VM's fleet history write for an event stands (the
state store's `history` record) and how a budget wake hint ended (the `maintd_budget_wake_hints_total` label).
The spellings they share with the approval record (`sending`, `sent`, `failed`) are its names, so each word has
one name. Imports nothing of `agent` outside `agent.model`."""

from __future__ import annotations

from typing import Final, Literal

from agent.model.approval import FAILED, SENDING, SENT

__all__ = ["EXISTED", "FAILED", "HISTORY_STATUSES", "RECORDED", "SENDING", "SENT", "WAKE_OUTCOMES", "HistoryStatus",
           "WakeOutcome"]

HistoryStatus = Literal["sending", "recorded", "existed", "failed"]
"""Where this VM's history write for an event stands. `sending` (SENDING): noted (written through) before the
create; found after a restart, the write is made once more."""
RECORDED: Final = "recorded"
EXISTED: Final = "existed"
"""The create found the record there (a retry of a write that had landed)."""
HISTORY_STATUSES: tuple[HistoryStatus, ...] = (SENDING, RECORDED, EXISTED, FAILED)

WakeOutcome = Literal["sent", "failed"]
"""How a budget wake hint ended: answered (SENT), or given up (FAILED)."""
WAKE_OUTCOMES: tuple[WakeOutcome, ...] = (SENT, FAILED)
