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

Queries never iterate from ``start_time``: the compiled rules are restarted (``rrule.replace``) at
a period of the interval shortly before the instant asked about, which yields the same occurrences.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from datetime import date, datetime, time, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from dateutil import rrule as rr

from agent.configschema import REQUIRED, choice, integer, list_of, opt, optional, parse_section, section, text
from agent.errors import ConfigValueError

FREQUENCIES = ("minute", "hour", "day", "week", "month")
MAX_INTERVAL = {"minute": 1000, "hour": 1000, "day": 548, "week": 78, "month": 18}
MAX_COUNT = 100_000
DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
DEFAULT_START = datetime(2000, 1, 1)

_UTC = timezone.utc
_FREQ = {"minute": rr.MINUTELY, "hour": rr.HOURLY, "day": rr.DAILY, "week": rr.WEEKLY, "month": rr.MONTHLY}
_UNIT = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1), "week": timedelta(weeks=1)}
_RR_DAYS = (rr.MO, rr.TU, rr.WE, rr.TH, rr.FR, rr.SA, rr.SU)
# How far before an instant a restarted rule begins: more than any jump of a UTC offset on record
# (Samoa skipped a whole day in 2011), so an occurrence DST moved past that instant is not missed.
_DST_MARGIN = timedelta(hours=26)


# --- value parsers ----------------------------------------------------------------------------

def _datetime(value: Any) -> datetime:
    """A date and time from YAML (a PyYAML timestamp or date) or ISO 8601 text; naive = wall clock."""
    if isinstance(value, datetime):
        return value
    if isinstance(value, date):
        return datetime.combine(value, time())
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.strip())
        except ValueError:
            pass
    raise ConfigValueError("", f"{value!r} is not a date and time; write e.g. 2026-01-05T09:00:00 "
                           "(wall clock in time_zone) or 2026-01-05T08:00:00Z")


def _day(value: Any) -> str:
    """A day of the week, full English name, any case."""
    name = value.strip().lower() if isinstance(value, str) else value
    if name in DAYS:
        return str(name)
    close = difflib.get_close_matches(str(name), DAYS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigValueError("", f"{value!r} is not a day of the week; use monday ... sunday{hint}")


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
    """The IANA time zone `name`; a ConfigValueError at key time_zone if there is none."""
    try:
        return ZoneInfo(name)
    except (ValueError, OSError, ZoneInfoNotFoundError):
        close = difflib.get_close_matches(name, available_timezones(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigValueError("time_zone", f"{name!r} is not an IANA time zone such as Europe/Stockholm or UTC{hint}") from None


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
class _Compiled:
    tz: ZoneInfo
    start: datetime  # naive wall clock of the start time
    origin: datetime  # naive wall clock of the start of start's period (minute, hour, day, week, month)
    rules: tuple[rr.rrule, ...]  # from start, bounded by until
    first: datetime  # the first occurrence, UTC
    until: datetime | None  # no occurrence after this (end_time, or the count-th occurrence), UTC


@dataclasses.dataclass(frozen=True)
class Recurrence:
    """An Azure Scheduler recurrence (see the module docstring); occurrences are returned in UTC."""

    frequency: str = opt(choice(*FREQUENCIES), REQUIRED, "minute, hour, day, week or month")
    interval: int = opt(integer(1), 1, "every that many frequency units (at most minute/hour 1000, day 548, week 78, month 18)")
    start_time: datetime | None = opt(optional(_datetime), None,
                                      "no occurrence before it; its phase, hour, minute and day are the defaults; "
                                      "default 2000-01-01T00:00 in time_zone")
    end_time: datetime | None = opt(optional(_datetime), None, "no occurrence after it (not with count)")
    count: int | None = opt(optional(integer(1, MAX_COUNT)), None,
                            "number of occurrences from start_time (needs start_time; not with end_time)")
    time_zone: str = opt(text(), "UTC", "IANA time zone of the wall-clock times, e.g. Europe/Stockholm")
    schedule: Schedule = opt(section(Schedule), Schedule(), "")
    _compiled: _Compiled = dataclasses.field(init=False, repr=False, compare=False)

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

    def _rules(self, start: datetime) -> list[tuple[str, rr.rrule]]:
        """The rrules from aware `start`, each with the schedule key it comes from. Every by-value is
        explicit so that `replace(dtstart=...)` keeps it. Within one rrule, day lists intersect (and plain
        weekdays intersect nth ones), so each kind of day list gets a rule of its own."""
        s = self.schedule
        hours: tuple[int, ...] | None = s.hours or None  # None: every hour (only kept so for minute/hour)
        if hours is None and self.frequency in ("day", "week", "month"):
            hours = tuple(range(24)) if s.minutes else (start.hour,)
        minutes = s.minutes or (None if self.frequency == "minute" else (start.minute,))
        common: dict[str, Any] = {"freq": _FREQ[self.frequency], "interval": self.interval, "dtstart": start,
                                  "wkst": rr.MO, "byhour": hours, "byminute": minutes, "bysecond": (0,)}
        if self.frequency == "week":
            days = [DAYS.index(d) for d in s.week_days] or [start.weekday()]
            return [("schedule.week_days", rr.rrule(byweekday=days, **common))]
        if self.frequency != "month":
            return [("schedule", rr.rrule(**common))]
        rules = []
        if s.month_days or not s.monthly_occurrences:
            rules.append(("schedule.month_days", rr.rrule(bymonthday=s.month_days or (start.day,), **common)))
        every = [_RR_DAYS[DAYS.index(o.day)] for o in s.monthly_occurrences if o.occurrence is None]
        nth = [_RR_DAYS[DAYS.index(o.day)](o.occurrence) for o in s.monthly_occurrences if o.occurrence is not None]
        rules += [("schedule.monthly_occurrences", rr.rrule(byweekday=days, **common)) for days in (every, nth) if days]
        return rules

    def _compile(self) -> _Compiled:
        tz = _zone(self.time_zone)
        start = _localize(self.start_time or DEFAULT_START, tz)
        end = None if self.end_time is None else _localize(self.end_time, tz).astimezone(_UTC)
        if end is not None and end <= start:
            raise ConfigValueError("end_time", "must be after start_time")
        try:
            keyed = self._rules(start)
            firsts = [(key, next(iter(rule), None)) for key, rule in keyed]
        except ValueError:  # rrule: the interval never lands on the hours/minutes
            raise ConfigValueError("schedule", f"never occurs: every {self.interval} {self.frequency}(s) from "
                                   f"{start:%H:%M} never reaches the listed hours/minutes") from None
        for key, occurrence in firsts:
            if occurrence is None:  # also keeps every query from searching up to year 9999
                raise ConfigValueError(key, "never occurs: no period the interval reaches has such a day")
        rules = [rule for _, rule in keyed]
        first = min(occurrence for _, occurrence in firsts if occurrence is not None).astimezone(_UTC)
        until = end
        if self.count is not None:
            until = deque(itertools.islice(_union(rules), self.count), maxlen=1)[0].astimezone(_UTC)
        if until is not None:
            if first > until:
                raise ConfigValueError("end_time", f"is before the first occurrence ({first.isoformat()})")
            rules = [rule.replace(until=until) for rule in rules]
        wall = start.replace(tzinfo=None)
        return _Compiled(tz, wall, _origin(self.frequency, wall), tuple(rules), first, until)

    def _wall(self, t: datetime) -> datetime:
        return t.astimezone(self._compiled.tz).replace(tzinfo=None)

    def _period(self, wall: datetime) -> int:
        """Index of the period (frequency unit) holding naive `wall`, counted from start_time's."""
        origin = self._compiled.origin
        if self.frequency == "month":
            return (wall.year - origin.year) * 12 + wall.month - origin.month
        return (wall - origin) // _UNIT[self.frequency]

    def _period_start(self, index: int) -> datetime:
        origin = self._compiled.origin
        if self.frequency == "month":
            years, month = divmod(origin.month - 1 + index, 12)
            return origin.replace(year=origin.year + years, month=month + 1)
        return origin + index * _UNIT[self.frequency]

    def _from(self, wall: datetime) -> rr.rruleset:
        """The rules restarted at naive `wall`, or at the next period the interval reaches:
        the same occurrences from there on, without iterating from start_time."""
        c = self._compiled
        if wall <= c.start:
            return _union(c.rules)
        period = self._period(wall)
        skip = -period % self.interval
        if skip:
            wall = self._period_start(period + skip)
        anchor = wall.replace(tzinfo=c.tz)
        return _union(rule.replace(dtstart=anchor) for rule in c.rules)

    def _after(self, t: datetime, inc: bool) -> datetime | None:
        until = self._compiled.until
        if until is not None and (t > until if inc else t >= until):
            return None
        hit = self._from(self._wall(t) - _DST_MARGIN).after(t, inc=inc)
        return None if hit is None else hit.astimezone(_UTC)

    def occurrences_after(self, t: datetime, n: int) -> list[datetime]:
        """The next `n` occurrences strictly after `t` (fewer if the recurrence ends), UTC, ascending."""
        _check_aware(t)
        found: list[datetime] = []
        if n <= 0:
            return found
        for occurrence in self._from(self._wall(t) - _DST_MARGIN):
            at = occurrence.astimezone(_UTC)
            if at > t and (not found or at > found[-1]):  # a DST gap can repeat an instant
                found.append(at)
                if len(found) == n:
                    break
        return found

    def last_at_or_before(self, t: datetime) -> datetime | None:
        """The latest occurrence at or before `t` (UTC), None if there is none yet."""
        _check_aware(t)
        c = self._compiled
        if t < c.first:
            return None
        if c.until is not None:
            t = min(t, c.until)
        wall = self._wall(t)
        back = _DST_MARGIN
        while True:  # look back twice as far each time; from start_time, `first` is found at the latest
            anchor = wall - back if back < wall - c.start else c.start
            hit = self._from(anchor).before(t, inc=True)
            if hit is not None:
                return hit.astimezone(_UTC)
            back *= 2

    def next_after(self, t: datetime) -> datetime | None:
        """The first occurrence strictly after `t` (UTC), None if the recurrence has ended."""
        _check_aware(t)
        return self._after(t, inc=False)


def _origin(frequency: str, start: datetime) -> datetime:
    """Start of the period (minute, hour, day, week from Monday, month) holding naive `start`."""
    if frequency == "minute":
        return start.replace(second=0, microsecond=0)
    if frequency == "hour":
        return start.replace(minute=0, second=0, microsecond=0)
    day = datetime.combine(start.date(), time())
    if frequency == "week":
        return day - timedelta(days=day.weekday())
    return day.replace(day=1) if frequency == "month" else day


def _union(rules: Iterable[rr.rrule]) -> rr.rruleset:
    union = rr.rruleset()
    for rule in rules:
        union.rrule(rule)
    return union


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
class _FixedDateConfig:
    start: datetime = opt(_datetime, REQUIRED, "first instant of the window")
    end: datetime = opt(_datetime, REQUIRED, "end of the window (exclusive; a date alone means its midnight)")
    time_zone: str = opt(text(), "UTC", "IANA time zone of start and end when they have no offset")


def parse_fixed_date(value: Any) -> FixedDate:
    """A `FixedDate` from ``{start, end, time_zone}``; raises ConfigValueError with a key relative to it."""
    config = parse_section(_FixedDateConfig, value)
    tz = _zone(config.time_zone)
    start = _localize(config.start, tz).astimezone(_UTC)
    end = _localize(config.end, tz).astimezone(_UTC)
    if end <= start:
        raise ConfigValueError("end", f"must be after start ({start.isoformat()})")
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
            since = max([window.start] + [o.end for o in earlier if window.start < o.end <= now])
            change = min([window.end] + [o.start for o in earlier if now < o.start < window.end])
            return Selection(i, since, change)

    recurrences = {i: s for i, s in enumerate(schedules) if isinstance(s, Recurrence)}
    latest = {i: at for i, r in recurrences.items() if (at := r.last_at_or_before(now)) is not None}
    ended = max((w.end for _, w in fixed if w.end <= now), default=None)
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
            at = winner._after(max(others), inc)
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
