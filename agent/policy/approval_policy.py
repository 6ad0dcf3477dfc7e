"""Profiles and approval rules, and the pure decision whether this VM may approve an event now;
which handler phase a transition starts.

Profiles (`profiles:`) are evaluated fixed date, then recurrence, then default (see `schedule`);
the one in force sets `approval` (auto, manual, never, immediate) and may narrow the handlers
that run and change the drain timings. Within a profile, `rules` match on event_types,
event_sources, max_duration_seconds and live_migration; the first match decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agent.errors import ConfigValueError
from agent.model.approval import APPROVAL_MODES, AUTO, IMMEDIATE, MANUAL, NEVER
from agent.model.config_schema import (
    boolean,
    choice,
    duration,
    fmt_duration,
    integer,
    list_of,
    named_list,
    opt,
    optional,
    parse_duration_text,
    parse_section,
    section,
    text,
)
from agent.model.events import KNOWN_TYPES, SCHEDULED, Event
from agent.model.gate_specs import Gates
from agent.policy.schedule import (
    FixedDate,
    Recurrence,
    Selection,
    parse_fixed_date,
    parse_recurrence,
    select,
    validate_profiles,
)

NOW = "now"
"""The lead time `now`: prepare at first sight (today's behaviour)."""
MAX_LEAD_TIME = 7 * 86400.0
"""The longest notice Azure gives (predicted hardware degradation: "tries to give 7 days")."""

LeadTime = float | str
"""Seconds before the event, or NOW."""


def parse_lead_time(value: Any) -> LeadTime:
    """A lead time: `now`, or a duration from 0 up to the longest notice Azure gives (7 days)."""
    if value == NOW:
        return NOW
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0 \
            or isinstance(value, str) and value.strip().startswith("-"):
        raise ConfigValueError("", f"{value!r} is negative; a lead time is a duration before NotBefore "
                               "(e.g. 10m) or now")
    try:
        seconds = parse_duration_text(value)
    except ValueError:
        raise ConfigValueError("", f"{value!r} is neither now nor a duration; write e.g. now, 10m, 2h, PT30M") from None
    if seconds > MAX_LEAD_TIME:
        raise ConfigValueError("", f"{value!r} is longer than any notice Azure gives ({fmt_duration(MAX_LEAD_TIME)}); "
                               "use now to prepare at first sight")
    return seconds


def parse_lead_times_by_type(value: Any) -> dict[str, LeadTime]:
    """`{EventType: lead time}` for the known event types."""
    if not isinstance(value, dict):
        raise ConfigValueError("", f"expected a mapping of event type to lead time, got {value!r}")
    out: dict[str, LeadTime] = {}
    for key, item in value.items():
        try:
            choice(*KNOWN_TYPES)(key)
            out[str(key)] = parse_lead_time(item)
        except ConfigValueError as exc:
            raise exc.under(str(key)) from None
    return out


@dataclass(frozen=True)
class ApprovalRule:
    """One rule of a profile: when it matches, `approval` decides."""

    approval: str = opt(choice(*APPROVAL_MODES), doc="auto (once every VM is ready), immediate, manual or never")
    event_types: tuple[str, ...] = opt(list_of(text(), unique=True), (), "match these EventTypes")
    event_sources: tuple[str, ...] = opt(list_of(choice("Platform", "User"), unique=True), (), "match these sources")
    max_duration_seconds: int | None = opt(optional(integer(0)), None,
                                           "match events announcing at most this impact (DurationInSeconds ≥ 0)")
    live_migration: bool | None = opt(optional(boolean), None, "match (true) or exclude (false) live migrations")

    def matches(self, event: Event) -> bool:
        """Whether every condition of the rule holds for the event."""
        if self.event_types and event.event_type not in self.event_types:
            return False
        if self.event_sources and event.source not in self.event_sources:
            return False
        if self.max_duration_seconds is not None and not 0 <= event.duration_seconds <= self.max_duration_seconds:
            return False
        if self.live_migration is not None and event.live_migration != self.live_migration:
            return False
        return True


@dataclass(frozen=True)
class Profile:
    """One profile: when it is in force and what it allows."""

    name: str = opt(text(r"^[A-Za-z0-9_.-]{1,64}$", "letters, digits, _ . -"), doc="profile name")
    approval: str = opt(choice(*APPROVAL_MODES), AUTO, "approval when no rule matches")
    rules: tuple[ApprovalRule, ...] = opt(list_of(lambda v: parse_section(ApprovalRule, v)), (),
                                          "ordered approval rules; the first match wins")
    fixed_date: FixedDate | None = opt(optional(parse_fixed_date), None, "in force between start and end")
    recurrence: Recurrence | None = opt(optional(parse_recurrence), None,
                                        "in force from each occurrence until another recurrence profile's next one")
    handlers: tuple[str, ...] | None = opt(optional(list_of(text(), unique=True)), None,
                                           "only these handlers run while the profile is in force (default all)")
    lb_timeout: float | None = opt(optional(duration(11, 3600)), None, "overrides probe.lb_timeout")
    drain_grace: float | None = opt(optional(duration(0, 3600)), None, "overrides probe.drain_grace")
    gates: Gates | None = opt(optional(section(Gates)), None, "replaces the top-level gates while in force")
    lead_time: LeadTime | None = opt(optional(parse_lead_time), None,
                                     "overrides prepare.lead_time for the windows of this profile and the events "
                                     "whose NotBefore falls in it (prepare.lead_time_by_type still wins)")

    def validate(self) -> None:
        if self.fixed_date is not None and self.recurrence is not None:
            raise ConfigValueError("recurrence", "a profile has either fixed_date or recurrence, not both")

    @property
    def schedule(self) -> FixedDate | Recurrence | None:
        """What decides when the profile is in force (None: the default profile)."""
        return self.fixed_date or self.recurrence

    def approval_for(self, event: Event) -> tuple[str, int | None]:
        """The approval mode for an event and the index of the rule that chose it (None: the profile's own)."""
        for i, rule in enumerate(self.rules):
            if rule.matches(event):
                return rule.approval, i
        return self.approval, None


DEFAULT_PROFILE = Profile(name="default", approval=AUTO)


def parse_profiles(value: Any) -> tuple[Profile, ...]:
    """The `profiles:` list: unique names, exactly one default (no fixed_date, no recurrence)."""
    if value is None:
        return (DEFAULT_PROFILE,)
    if not isinstance(value, list) or not value:
        raise ConfigValueError("", "profiles is a non-empty list; leave it out for one default profile "
                               "(approval: auto)")
    profiles = named_list(value, lambda item: parse_section(Profile, item), "profile")
    validate_profiles([p.schedule for p in profiles])
    return profiles


def check_handler_names(profiles: tuple[Profile, ...], handler_names: set[str]) -> None:
    """A profile may only name configured handlers."""
    for i, p in enumerate(profiles):
        for j, name in enumerate(p.handlers or ()):
            if name not in handler_names:
                raise ConfigValueError(f"[{i}].handlers[{j}]", f"no handler named {name!r} is configured; "
                                       f"configured: {', '.join(sorted(handler_names)) or 'none'}")


def in_force(profiles: tuple[Profile, ...], now: datetime) -> tuple[Profile, Selection]:
    """The profile in force at `now`, and when that may change."""
    selection = select([p.schedule for p in profiles], now)
    return (profiles[selection.index] if selection.index >= 0 else DEFAULT_PROFILE), selection


@dataclass(frozen=True)
class Decision:
    """Whether to send the approval now, and why (or why not)."""

    approve: bool
    reason: str


def may_approve(mode: str, local_pending: Sequence[str], manual_requested: bool) -> bool:
    """This VM's own side of `decide` for a Scheduled event not yet approved, the peers aside: `immediate` at once;
    `auto` once no local handler holds it; `manual` once an operator said so and no local handler holds it."""
    if mode == IMMEDIATE:
        return True
    return not local_pending and (mode == AUTO or (mode == MANUAL and manual_requested))


def decide(*, mode: str, status: str, already_sent: bool, manual_requested: bool,
           local_pending: list[str], peers_not_ready: list[str], lower_ranked_reachable: list[str],
           dry_run: bool) -> Decision:
    """The approval decision for one event on this VM (pure).

    `lower_ranked_reachable` are the VMs ranked before this one that answered recently (the
    leader is rank 0; a VM of rank r takes over only when all of them have been unreachable for
    `takeover_after`, which the caller has already applied).
    """
    if status != SCHEDULED:
        return Decision(False, f"event is {status}")
    if already_sent:
        return Decision(False, "already approved")
    if mode == NEVER:
        return Decision(False, "profile forbids approval (never)")
    if mode == MANUAL:
        if not manual_requested:
            return Decision(False, "waiting for an operator: maintd approve EVENT_ID")
        if local_pending:  # the operator's go starts a held preparation; the event waits until it is done
            return Decision(False, f"approved by an operator; waiting for local handlers: {', '.join(local_pending)}")
        return Decision(not dry_run, "approved by an operator" + (" (dry run: not sent)" if dry_run else ""))
    if lower_ranked_reachable:
        return Decision(False, f"not the leader: {', '.join(lower_ranked_reachable[:5])} ranked before this VM")
    if mode == AUTO:
        if local_pending:
            return Decision(False, f"waiting for local handlers: {', '.join(local_pending)}")
        if peers_not_ready:
            more = f" (+{len(peers_not_ready) - 5} more)" if len(peers_not_ready) > 5 else ""
            return Decision(False, f"waiting for peers: {', '.join(peers_not_ready[:5])}{more}")
    if dry_run:
        return Decision(False, "dry run: approval not sent")
    return Decision(True, "every affected VM is ready" if mode == AUTO else "immediate by policy")
