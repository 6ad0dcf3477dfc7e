"""Maintenance-window schedules: Azure Scheduler recurrences, fixed dates, and the profile in force.

A `Recurrence` has the Azure Scheduler's recurrence shape (``frequency``, ``interval``,
``start_time``, ``count`` or ``end_time``, ``schedule`` with ``minutes``, ``hours``, ``week_days``,
``month_days``, ``monthly_occurrences``) plus an IANA ``time_zone``, and is compiled once into
`dateutil.rrule` rules. Its semantics:

- Times without a UTC offset are wall-clock times in ``time_zone`` (default UTC); occurrences are
  wall-clock times too, so 01:00 stays 01:00 across DST. A wall time that DST skips falls after the
  gap (02:30 becomes 03:30); a repeated one happens once, the first time.
- ``start_time`` defaults to 2000-01-01T00:00 in ``time_zone``. A past start time yields the first
  future occurrence computed from it, keeping the phase of ``interval``.
- Missing ``minutes`` default to the start time's minute. Missing ``hours`` default to its hour,
  except that ``minutes`` without ``hours`` means every hour, as in the Scheduler's examples
  ("every 15 minutes on weekdays": ``{minutes: [0, 15, 30, 45], week_days: [...]}``). Missing
  ``week_days`` / ``month_days`` default to the start time's weekday / day of the month.
- ``month_days`` together with ``monthly_occurrences`` means either: the union of two rules (a
  single rrule would intersect them).
- ``count`` counts occurrences from ``start_time``, so it needs one; ``end_time`` is inclusive.

Profiles are evaluated as Azure autoscale does: the first fixed date containing now wins; else the
recurrence profile with the most recent occurrence at or before now, whose window lasts until
another recurrence profile's next occurrence (equal instants: the first listed wins); else the
default profile.

A recurrence is compiled (and its occurrences computed) by `agent.policy.recurrence`, imported only when a
config has one: dateutil stays unloaded otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, date, datetime, time
from typing import TYPE_CHECKING, Any

from agent.errors import ConfigValueError
from agent.model.config_schema import (
    REQUIRED,
    choice,
    did_you_mean,
    integer,
    list_of,
    opt,
    optional,
    parse_section,
    section,
    text,
)
from agent.model.timefmt import iso_z, parse_iso

if TYPE_CHECKING:
    from zoneinfo import ZoneInfo

    from agent.policy.recurrence import Rules

FREQUENCIES = ("minute", "hour", "day", "week", "month")
MAX_INTERVAL = {"minute": 1000, "hour": 1000, "day": 548, "week": 78, "month": 18}
MAX_COUNT = 100_000
DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
DEFAULT_START = datetime(2000, 1, 1)

_UTC = UTC


# --- value parsers ----------------------------------------------------------------------------

def _datetime(value: Any) -> datetime:
    """A date and time from YAML (a PyYAML timestamp or date) or ISO 8601 text; naive = wall clock."""
    if isinstance(value, datetime):
        return value
    if isinstance(value, date):
        return datetime.combine(value, time())
    if isinstance(value, str):
        try:
            return parse_iso(value.strip())
        except ValueError:
            pass
    raise ConfigValueError("", f"{value!r} is not a date and time; write e.g. 2026-01-05T09:00:00 "
                           "(wall clock in time_zone) or 2026-01-05T08:00:00Z")


def _day(value: Any) -> str:
    """A day of the week, full English name, any case."""
    name = value.strip().lower() if isinstance(value, str) else value
    if name in DAYS:
        return str(name)
    raise ConfigValueError("", f"{value!r} is not a day of the week; use monday ... sunday"
                               f"{did_you_mean(str(name), DAYS)}")


def _month_day(value: Any) -> int:
    """1..31, or -1..-31 counting from the end of the month."""
    day = integer(-31, 31)(value)
    if day == 0:
        raise ConfigValueError("", "0 is not a day of the month; use 1..31, or -1..-31 from the end (-1 = last day)")
    return int(day)


def _occurrence(value: Any) -> int:
    """1..5 from the start of the month, -1..-5 from its end."""
    occurrence = integer(-5, 5)(value)
    if occurrence == 0:
        raise ConfigValueError("", "0 is not an occurrence; use 1..5 (first..fifth) or -1..-5 (last..fifth from last)")
    return int(occurrence)


def _zone(name: str) -> ZoneInfo:
    """The IANA time zone `name`; a ConfigValueError at key time_zone if there is none. (zoneinfo loads
    only for a config with a schedule.)"""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

    try:
        return ZoneInfo(name)
    except (ValueError, OSError, ZoneInfoNotFoundError):
        hint = did_you_mean(name, available_timezones())
        raise ConfigValueError("time_zone",
                               f"{name!r} is not an IANA time zone such as Europe/Stockholm or UTC{hint}") from None


def _localize(value: datetime, tz: ZoneInfo) -> datetime:
    """`value` as an aware time in `tz`; a naive value is taken as wall clock there."""
    return value.replace(tzinfo=tz) if value.tzinfo is None else value.astimezone(tz)


def _check_aware(t: datetime) -> None:
    if t.tzinfo is None or t.utcoffset() is None:
        raise ValueError(f"{t!r} is naive; pass a timezone-aware time")


# --- recurrences ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MonthlyOccurrence:
    """A weekday of the month: the `occurrence`-th one (negative: from the end), or every one."""

    day: str = opt(_day, REQUIRED, "monday ... sunday")
    occurrence: int | None = opt(optional(_occurrence), None,
                                 "1..5 (first..fifth) or -1..-5 (last..fifth from last); omitted: every such day")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Where in each period occurrences fall; empty lists take their defaults from the start time."""

    minutes: tuple[int, ...] = opt(list_of(integer(0, 59), 1, unique=True), (),
                                   "minutes of the hour; default: start_time's minute")
    hours: tuple[int, ...] = opt(list_of(integer(0, 23), 1, unique=True), (),
                                 "hours of the day; default: start_time's hour, or every hour if minutes are given")
    week_days: tuple[str, ...] = opt(list_of(_day, 1, unique=True), (),
                                     "frequency week only: monday ... sunday; default: start_time's weekday")
    month_days: tuple[int, ...] = opt(list_of(_month_day, 1, unique=True), (),
                                      "frequency month only: 1..31, -1..-31 from the end; default: start_time's day")
    monthly_occurrences: tuple[MonthlyOccurrence, ...] = opt(
        list_of(section(MonthlyOccurrence), 1, unique=True), (),
        "frequency month only: [{day: friday, occurrence: -1}] = last Friday; with month_days: either matches")


@dataclasses.dataclass(frozen=True)
class Recurrence:
    """An Azure Scheduler recurrence (see the module docstring); occurrences are returned in UTC."""

    frequency: str = opt(choice(*FREQUENCIES), REQUIRED, "minute, hour, day, week or month")
    interval: int = opt(integer(1), 1,
                        "every that many frequency units (at most minute/hour 1000, day 548, week 78, month 18)")
    start_time: datetime | None = opt(optional(_datetime), None,
                                      "no occurrence before it; its phase, hour, minute and day are the defaults; "
                                      "default 2000-01-01T00:00 in time_zone")
    end_time: datetime | None = opt(optional(_datetime), None, "no occurrence after it (not with count)")
    count: int | None = opt(optional(integer(1, MAX_COUNT)), None,
                            "number of occurrences from start_time (needs start_time; not with end_time)")
    time_zone: str = opt(text(), "UTC", "IANA time zone of the wall-clock times, e.g. Europe/Stockholm")
    schedule: Schedule = opt(section(Schedule), Schedule(), "")
    _compiled: Rules = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check()
        object.__setattr__(self, "_compiled", self._compile())

    def _check(self) -> None:
        """Refuse the combinations the Scheduler refuses (and a weekly rule falling on 2000-01-01's weekday)."""
        limit = MAX_INTERVAL[self.frequency]
        if self.interval > limit:
            raise ConfigValueError("interval", f"with frequency {self.frequency} the interval is at most {limit} "
                                   "(the Azure Scheduler's limit)")
        for key, only in (("week_days", "week"), ("month_days", "month"), ("monthly_occurrences", "month")):
            if getattr(self.schedule, key) and self.frequency != only:
                raise ConfigValueError(f"schedule.{key}", f"only allowed with frequency {only}, "
                                       f"not {self.frequency}")
        if self.count is not None and self.end_time is not None:
            raise ConfigValueError("end_time", "count and end_time exclude each other; keep one")
        if self.count is not None and self.start_time is None:
            raise ConfigValueError("count", "needs start_time: occurrences are counted from it")
        if self.frequency == "week" and not self.schedule.week_days and self.start_time is None:
            raise ConfigValueError("schedule.week_days", "frequency week without start_time needs week_days "
                                   "(the default start, 2000-01-01, is a Saturday)")

    def _compile(self) -> Rules:
        from agent.policy.recurrence import Pattern, compile_rules  # dateutil: only for a config with a recurrence

        tz = _zone(self.time_zone)
        start = _localize(self.start_time or DEFAULT_START, tz)
        end = None if self.end_time is None else _localize(self.end_time, tz).astimezone(_UTC)
        if end is not None and end <= start:
            raise ConfigValueError("end_time", "must be after start_time")
        s = self.schedule
        pattern = Pattern(s.minutes, s.hours, tuple(DAYS.index(d) for d in s.week_days), s.month_days,
                          tuple((DAYS.index(o.day), o.occurrence) for o in s.monthly_occurrences))
        return compile_rules(self.frequency, self.interval, pattern, tz, start, end, self.count)

    def occurrences_after(self, t: datetime, n: int) -> list[datetime]:
        """The next `n` occurrences strictly after `t` (fewer if the recurrence ends), UTC, ascending."""
        _check_aware(t)
        return self._compiled.occurrences_after(t, n)

    def last_at_or_before(self, t: datetime) -> datetime | None:
        """The latest occurrence at or before `t` (UTC), None if there is none yet."""
        _check_aware(t)
        return self._compiled.last_at_or_before(t)

    def next_after(self, t: datetime) -> datetime | None:
        """The first occurrence strictly after `t` (UTC), None if the recurrence has ended."""
        _check_aware(t)
        return self._compiled.after(t, inc=False)


def parse_recurrence(value: Any) -> Recurrence:
    """A `Recurrence` from its config mapping; raises ConfigValueError with a key relative to it."""
    return parse_section(Recurrence, value)


# --- fixed dates ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FixedDate:
    """A window from `start` (inclusive) to `end` (exclusive), both aware UTC."""

    start: datetime
    end: datetime

    def contains(self, t: datetime) -> bool:
        """Whether aware `t` falls in the window."""
        _check_aware(t)
        return self.start <= t < self.end


@dataclasses.dataclass(frozen=True)
class FixedDateConfig:
    start: datetime = opt(_datetime, REQUIRED, "first instant of the window")
    end: datetime = opt(_datetime, REQUIRED, "end of the window (exclusive; a date alone means its midnight)")
    time_zone: str = opt(text(), "UTC", "IANA time zone of start and end when they have no offset")


def parse_fixed_date(value: Any) -> FixedDate:
    """A `FixedDate` from ``{start, end, time_zone}``; raises ConfigValueError with a key relative to it."""
    config = parse_section(FixedDateConfig, value)
    tz = _zone(config.time_zone)
    start = _localize(config.start, tz).astimezone(_UTC)
    end = _localize(config.end, tz).astimezone(_UTC)
    if end <= start:
        raise ConfigValueError("end", f"must be after start ({iso_z(start)})")
    return FixedDate(start, end)


# --- profile selection ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Selection:
    """The profile in force: an index into the schedules (-1: none applies), since when it has been
    (None: always, as far as the schedules tell) and the next instant the answer could change."""

    index: int
    since: datetime | None
    next_change: datetime | None


def select(schedules: Sequence[FixedDate | Recurrence | None], now: datetime) -> Selection:
    """Which of the profiles' schedules (config order, None = the default profile) is in force at `now`."""
    _check_aware(now)
    fixed = [(i, s) for i, s in enumerate(schedules) if isinstance(s, FixedDate)]
    for i, window in fixed:
        if window.contains(now):
            earlier = [other for j, other in fixed if j < i]
            opened = max([window.start] + [o.end for o in earlier if window.start < o.end <= now])
            change = min([window.end] + [o.start for o in earlier if now < o.start < window.end])
            return Selection(i, opened, change)

    recurrences = {i: s for i, s in enumerate(schedules) if isinstance(s, Recurrence)}
    latest = {i: at for i, r in recurrences.items() if (at := r.last_at_or_before(now)) is not None}
    ended = max((w.end for _, w in fixed if w.end <= now), default=None)
    since: datetime | None
    if latest:
        index = max(latest, key=lambda i: (latest[i], -i))
        since = _switched(recurrences[index], index, latest)
        if ended is not None:
            since = max(since, ended)
    else:
        index = next((i for i, s in enumerate(schedules) if s is None), -1)
        since = ended
    upcoming = [w.start for _, w in fixed if w.start > now]
    upcoming += [at for i, r in recurrences.items() if i != index and (at := r.next_after(now)) is not None]
    return Selection(index, since, min(upcoming, default=None))


def _switched(winner: Recurrence, index: int, latest: dict[int, datetime]) -> datetime:
    """When `winner` last took over from the other recurrences: its first occurrence after those
    listed before it (they win ties) and at or after those listed after it."""
    switched = winner._compiled.first
    for inc, others in ((False, [at for i, at in latest.items() if i < index]),
                        (True, [at for i, at in latest.items() if i > index])):
        if others:
            at = winner._compiled.after(max(others), inc)
            assert at is not None  # the winner's own latest occurrence qualifies
            switched = max(switched, at)
    return switched


def validate_profiles(schedules: Sequence[FixedDate | Recurrence | None]) -> None:
    """Require exactly one default profile (None); keys are relative to the profile list."""
    defaults = [i for i, s in enumerate(schedules) if s is None]
    if not defaults:
        raise ConfigValueError("", "no default profile: add one without fixed_date and recurrence; "
                               "it applies when no other does")
    if len(defaults) > 1:
        raise ConfigValueError(f"[{defaults[1]}]", f"a second default profile (profile [{defaults[0]}] is one); "
                               "give it a fixed_date or a recurrence, or remove it")
