"""The approval's words, defined once: the approval modes a profile gives, the state store's approval
record (its key and statuses, written by the approver and read by the coordinator, the API and the
webhook), the operator's manual approval record and the approval's fields of /v1/events/{id}. Imports nothing
of `agent`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, NotRequired, TypedDict

ApprovalMode = Literal["auto", "immediate", "manual", "never"]
AUTO: Final = "auto"
IMMEDIATE: Final = "immediate"
MANUAL: Final = "manual"
NEVER: Final = "never"
APPROVAL_MODES: tuple[ApprovalMode, ...] = (AUTO, IMMEDIATE, MANUAL, NEVER)
ALLOWING: tuple[ApprovalMode, ...] = (AUTO, IMMEDIATE)
"""Approval modes under which this VM approves without an operator: a window that allows approval."""
AWAITING_PREPARATION: tuple[ApprovalMode, ...] = (AUTO, MANUAL)
"""Approval modes that wait for this VM's own preparation (`immediate` approves at once)."""

APPROVAL_KEY: Final = "approval"
"""The state store's result key of this VM's approval record."""
MANUAL_APPROVAL_KEY: Final = "manual_approval"
"""The state store's result key of an operator's `maintd approve`."""

ApprovalStatus = Literal["sending", "sent", "failed"]
SENDING: Final = "sending"
"""Recorded before the first POST: a restart that finds it waits before sending again."""
SENT: Final = "sent"
FAILED: Final = "failed"

ApprovalOutcome = Literal["sent", "failed", "skipped"]
"""How an approval POST ended (the `maintd_approvals_total` label): sent, failed, or not made (SKIPPED)."""
SKIPPED: Final = "skipped"
APPROVAL_OUTCOMES: tuple[ApprovalOutcome, ...] = (SENT, FAILED, SKIPPED)


class ApprovalRecord(TypedDict, total=False):
    """The approval record as the approver writes it (`status`, `by` and `at` always)."""

    status: ApprovalStatus
    by: str
    at: str
    reason: str
    attempts: int
    error: str


class HeldJson(TypedDict):
    """The gate holding an approval and why (`approval_held` of /v1/events/{id})."""

    gate: str
    reason: str


class ApprovalView(TypedDict):
    """The approval's fields of /v1/events/{id} (`Coordinator.view`): this VM's approval record (read back: any
    shape); once the coordinator has decided for the event, the mode, the profile's rule, the decision and the
    gate holding it. What a plan's JSON reads of the coordination (`prepare_plan.with_coordination`)."""

    approval: dict[str, Any] | None
    approval_mode: NotRequired[str]
    approval_rule: NotRequired[int | None]
    approval_decision: NotRequired[str | None]
    approval_held: NotRequired[HeldJson | None]


def has_status(record: Mapping[str, Any] | None, status: ApprovalStatus) -> bool:
    """The record (as read back from the state store: any shape) has this status."""
    return record is not None and record.get("status") == status


def acts_now(status: str, results: Mapping[str, Any]) -> bool:
    """Whether the platform acts on an event now, whatever a disruption budget says: it is Started, this VM's
    approval was sent (or is being sent: the POST may have gone), or an operator ordered it (`maintd approve`).
    `status`: the event's, in IMDS's words (this module imports nothing of `agent`)."""
    rec = results.get(APPROVAL_KEY)
    return status != "Scheduled" or MANUAL_APPROVAL_KEY in results or (
        isinstance(rec, Mapping) and (has_status(rec, SENT) or has_status(rec, SENDING)))


def approved_by(record: Mapping[str, Any] | None) -> str | None:
    """The VM that sent the approval, when the record says it was sent."""
    by = record.get("by") if record is not None and has_status(record, SENT) else None
    return by if isinstance(by, str) else None
