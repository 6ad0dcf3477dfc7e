"""When to prepare for an event and from when it may be approved: the plan (pure; time is a parameter).

Preparation (the scheduled-phase handlers) starts at the first of

- the moment this VM would be allowed to approve: at once when the profile in force allows
  approval (`auto` or `immediate`) now; else the start of the first *window* — an instant from which
  a profile allowing approval is in force — before NotBefore, minus that window's lead time;
- NotBefore minus the lead time of the profile in force at NotBefore;

and never before now. The lead time of an event is, most specific first,
`prepare.lead_time_by_type[EventType]`, the profile's `lead_time`, `prepare.lead_time`; `now`
means at first sight, so the default config prepares every event at once, as before.

Approval is not before the window's start. Without a window before NotBefore this VM never
approves (an operator may under a `manual` profile) and Azure starts the event at NotBefore.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypedDict

from agent.model.approval import ALLOWING, MANUAL, ApprovalView
from agent.model.config_schema import fmt_duration, opt
from agent.model.events import Event
from agent.model.timefmt import iso_z_or_none
from agent.policy.approval_policy import (
    MAX_LEAD_TIME,
    NOW,
    LeadTime,
    Profile,
    in_force,
    parse_lead_time,
    parse_lead_times_by_type,
)

MAX_STEPS = 1000
"""Instants looked at when searching for a window's opening or its closing (a bound, never reached by a sane config)."""



@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """When the scheduled-phase handlers start (see agent.prepare.prepare_plan): the lead time covers
    the whole preparation."""

    lead_time: LeadTime = opt(parse_lead_time, NOW,
                              "prepare this long before NotBefore (or before a window that allows approval "
                              "opens); now = at first sight; at most 7d")
    lead_time_by_type: dict[str, LeadTime] = opt(parse_lead_times_by_type, {},
                                                 "per EventType lead time, e.g. {Reboot: 10m, Preempt: now}; "
                                                 "wins over profiles[].lead_time and lead_time")


def fmt_lead(lead: LeadTime) -> str:
    """A lead time as written in the config: `now` or a duration such as 10m."""
    return NOW if lead == NOW else fmt_duration(float(lead))


class WindowJson(TypedDict):
    """The `window` of a plan's JSON."""

    profile: str
    approval: str
    start: str | None
    end: str | None


class PlanJson(TypedDict):
    """A plan as the `plan` object of /v1/events/{id} and the `plan.*` journal lines show it."""

    prepare_at: str | None
    prepare_reason: str
    prepare_detail: str
    approve_not_before: str | None
    approve_reason: str
    approve_detail: str
    not_before: str | None
    lead_time: str
    window: WindowJson | None


class PlanView(PlanJson):
    """The `plan` object of /v1/events/{id} (`Preparation.view`): the plan as the coordination holds it now, and
    whether preparation is held or started."""

    preparation: str


@dataclass(frozen=True)
class Window:
    """From `start`, `profile` (approval `mode`) lets this VM approve the event, until `end` (None: past NotBefore)."""

    start: datetime
    end: datetime | None
    profile: str
    mode: str

    def to_json(self) -> WindowJson:
        return {"profile": self.profile, "approval": self.mode, "start": iso_z_or_none(self.start),
                "end": iso_z_or_none(self.end)}


@dataclass(frozen=True)
class Plan:
    """What will happen when for one event: prepare at, approve not before, NotBefore (and why)."""

    prepare_at: datetime
    prepare_reason: str  # now | window | lead_time
    prepare_detail: str
    approve_not_before: datetime | None
    approve_reason: str  # window | operator | no_window
    approve_detail: str
    not_before: datetime | None
    lead_time: LeadTime
    window: Window | None

    def due(self, now: datetime) -> bool:
        """Whether preparation should have started by `now`."""
        return self.prepare_at <= now

    def to_json(self) -> PlanJson:
        return {"prepare_at": iso_z_or_none(self.prepare_at), "prepare_reason": self.prepare_reason,
                "prepare_detail": self.prepare_detail, "approve_not_before": iso_z_or_none(self.approve_not_before),
                "approve_reason": self.approve_reason, "approve_detail": self.approve_detail,
                "not_before": iso_z_or_none(self.not_before), "lead_time": fmt_lead(self.lead_time),
                "window": self.window.to_json() if self.window else None}


def lead_time_for(event_type: str, profile: Profile, prepare: PrepareConfig) -> LeadTime:
    """The lead time of an event under `profile`: by type, else the profile's, else prepare.lead_time."""
    if event_type in prepare.lead_time_by_type:
        return prepare.lead_time_by_type[event_type]
    return profile.lead_time if profile.lead_time is not None else prepare.lead_time


def _openings(profiles: tuple[Profile, ...], allowing: list[Profile], t: datetime) -> datetime | None:
    """The next instant after `t` at which an allowing profile can come into force: one of its own
    occurrences or starts, or the end of a fixed date that hid it (recurrences only ever accumulate,
    so nothing else can hand over to it)."""
    found = [p.fixed_date.end for p in profiles if p.fixed_date is not None and p.fixed_date.end > t]
    for p in allowing:
        if p.fixed_date is not None and p.fixed_date.start > t:
            found.append(p.fixed_date.start)
        elif p.recurrence is not None and (at := p.recurrence.next_after(t)) is not None:
            found.append(at)
    return min(found, default=None)


def first_window(event: Event, profiles: tuple[Profile, ...], now: datetime, until: datetime) -> Window | None:
    """The first window open at `now` or opening before `until`, and when it closes (None: not before `until`).

    Only the instants at which an allowing profile can come into force are looked at, so a config
    whose other profiles change every few minutes costs no more than one that never changes."""
    allowing = [p for p in profiles if p.approval_for(event)[0] in ALLOWING]
    t: datetime | None = now
    for _ in range(MAX_STEPS):
        if t is None or t >= until or not allowing:
            return None
        profile, selection = in_force(profiles, t)
        mode = profile.approval_for(event)[0]
        if mode in ALLOWING:  # open already at `now`: since when the profile has been in force
            start = min(t, selection.since) if selection.since else t
            return Window(start, _closing(event, profiles, selection.next_change, until), profile.name, mode)
        t = _openings(profiles, allowing, t)
    return None


def _closing(event: Event, profiles: tuple[Profile, ...], t: datetime | None, until: datetime) -> datetime | None:
    """The first profile change from `t` on to a profile that does not allow approval, if before `until`."""
    for _ in range(MAX_STEPS):
        if t is None or t >= until:
            return None
        profile, selection = in_force(profiles, t)
        if profile.approval_for(event)[0] not in ALLOWING:
            return t
        t = selection.next_change
    return None


def _before(t: datetime, lead: LeadTime) -> datetime | None:
    """`lead` before `t` (None for `now`: at first sight)."""
    return None if lead == NOW else t - timedelta(seconds=float(lead))


def make_plan(event: Event, profiles: tuple[Profile, ...], prepare: PrepareConfig, now: datetime) -> Plan:
    """The plan for an event seen (or re-planned) at `now`."""
    not_before = event.not_before
    until = not_before if not_before is not None else now + timedelta(seconds=MAX_LEAD_TIME)
    window = first_window(event, profiles, now, until)
    at_deadline = in_force(profiles, not_before)[0] if not_before is not None and not_before > now \
        else in_force(profiles, now)[0]
    lead = lead_time_for(event.event_type, at_deadline, prepare)

    if window is not None and window.start <= now:
        prepare_at, reason, detail = now, "now", f"profile {window.profile} allows approval ({window.mode}) now"
    elif lead == NOW or not_before is None:
        prepare_at, reason, detail = now, "now", ("lead time now: prepare at first sight" if lead == NOW
                                                  else "no NotBefore: prepare at first sight")
    else:
        deadline_start = _before(not_before, lead)
        assert deadline_start is not None
        prepare_at, reason = deadline_start, "lead_time"
        detail = f"lead time {fmt_lead(lead)} before NotBefore"
        if window is not None:
            profile = next(p for p in profiles if p.name == window.profile)
            window_lead = lead_time_for(event.event_type, profile, prepare)
            window_start = _before(window.start, window_lead)
            if window_start is None or window_start < prepare_at:
                prepare_at, reason, lead = window_start or now, "window", window_lead
                detail = (f"lead time {fmt_lead(window_lead)} before profile {window.profile} "
                          f"({window.mode}) comes into force at {iso_z_or_none(window.start)}")
        if prepare_at < now:
            prepare_at, detail = now, detail + "; less time than that is left: at once"

    approve: tuple[datetime | None, str, str]
    if window is not None:
        approve = (window.start, "window",
                   f"profile {window.profile} ({window.mode}) from {iso_z_or_none(window.start)}"
                   + (f" until {iso_z_or_none(window.end)}" if window.end else ""))
    elif in_force(profiles, now)[0].approval_for(event)[0] == MANUAL:
        approve = (None, "operator", "waiting for an operator: maintd approve EVENT_ID")
    else:
        approve = (None, "no_window", "no window before NotBefore: this VM does not approve; "
                   "Azure starts the event at NotBefore")
    approve_at, approve_reason, approve_detail = approve
    return Plan(prepare_at, reason, detail, approve_at, approve_reason, approve_detail, not_before=not_before,
                lead_time=lead, window=window)


def with_coordination(plan: PlanJson, coordination: ApprovalView) -> PlanJson:
    """A plan's JSON with what holds the approval right now (a gate, peers) from the coordinator's view."""
    held = coordination.get("approval_held")
    decision = str(coordination.get("approval_decision") or "")
    if isinstance(held, dict):
        return {**plan, "approve_reason": "gate",
                "approve_detail": f"held by gate {held.get('gate')}: {held.get('reason')}"}
    if decision.startswith("waiting for peers"):
        return {**plan, "approve_reason": "peers", "approve_detail": decision}
    return plan
