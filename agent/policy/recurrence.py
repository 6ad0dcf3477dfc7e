"""A recurrence compiled into `dateutil.rrule` rules, and the queries on it (see `agent.policy.schedule`
for the semantics).

Apart from `agent.policy.schedule` so that only a config with a recurrence loads dateutil: the schedule
module parses and checks the recurrence, this one computes its occurrences.

Queries never iterate from the start time: the rules are restarted (``rrule.replace``) at a period
of the interval shortly before the instant asked about, which yields the same occurrences.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Iterable
from datetime import UTC, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from dateutil import rrule as rr

from agent.errors import ConfigValueError
from agent.model.timefmt import iso_z

_UTC = UTC
_FREQ = {"minute": rr.MINUTELY, "hour": rr.HOURLY, "day": rr.DAILY, "week": rr.WEEKLY, "month": rr.MONTHLY}
_UNIT = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1),
         "week": timedelta(weeks=1)}
_RR_DAYS = (rr.MO, rr.TU, rr.WE, rr.TH, rr.FR, rr.SA, rr.SU)
# How far before an instant a restarted rule begins: more than any jump of a UTC offset on record
# (Samoa skipped a whole day in 2011), so an occurrence DST moved past that instant is not missed.
_DST_MARGIN = timedelta(hours=26)


@dataclasses.dataclass(frozen=True)
class Pattern:
    """Where in each period occurrences fall: weekdays are 0 (Monday) .. 6; empty lists take their
    defaults from the start time; `monthly_occurrences` pairs a weekday with its occurrence (None: every)."""

    minutes: tuple[int, ...] = ()
    hours: tuple[int, ...] = ()
    week_days: tuple[int, ...] = ()
    month_days: tuple[int, ...] = ()
    monthly_occurrences: tuple[tuple[int, int | None], ...] = ()


@dataclasses.dataclass(frozen=True)
class Rules:
    """The compiled recurrence; every query takes and returns aware times, results in UTC."""

    frequency: str
    interval: int
    tz: ZoneInfo
    start: datetime  # naive wall clock of the start time
    origin: datetime  # naive wall clock of the start of start's period (minute, hour, day, week, month)
    rules: tuple[rr.rrule, ...]  # from start, bounded by until
    first: datetime  # the first occurrence, UTC
    until: datetime | None  # no occurrence after this (end_time, or the count-th occurrence), UTC

    def _wall(self, t: datetime) -> datetime:
        return t.astimezone(self.tz).replace(tzinfo=None)

    def _period(self, wall: datetime) -> int:
        """Index of the period (frequency unit) holding naive `wall`, counted from start_time's."""
        if self.frequency == "month":
            return (wall.year - self.origin.year) * 12 + wall.month - self.origin.month
        return (wall - self.origin) // _UNIT[self.frequency]

    def _period_start(self, index: int) -> datetime:
        origin = self.origin
        if self.frequency == "month":
            years, month = divmod(origin.month - 1 + index, 12)
            return origin.replace(year=origin.year + years, month=month + 1)
        return origin + index * _UNIT[self.frequency]

    def _from(self, wall: datetime) -> rr.rruleset:
        """The rules restarted at naive `wall`, or at the next period the interval reaches:
        the same occurrences from there on, without iterating from start_time."""
        if wall <= self.start:
            return _union(self.rules)
        period = self._period(wall)
        skip = -period % self.interval
        if skip:
            wall = self._period_start(period + skip)
        anchor = wall.replace(tzinfo=self.tz)
        return _union(rule.replace(dtstart=anchor) for rule in self.rules)

    def after(self, t: datetime, inc: bool) -> datetime | None:
        """The first occurrence after `t` (at or after it with `inc`), None if the recurrence has ended."""
        if self.until is not None and (t > self.until if inc else t >= self.until):
            return None
        hit = self._from(self._wall(t) - _DST_MARGIN).after(t, inc=inc)
        return None if hit is None else hit.astimezone(_UTC)

    def occurrences_after(self, t: datetime, n: int) -> list[datetime]:
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
        if t < self.first:
            return None
        if self.until is not None:
            t = min(t, self.until)
        wall = self._wall(t)
        back = _DST_MARGIN
        while True:  # look back twice as far each time; from start_time, `first` is found at the latest
            anchor = wall - back if back < wall - self.start else self.start
            hit = self._from(anchor).before(t, inc=True)
            if hit is not None:
                return hit.astimezone(_UTC)
            back *= 2


def _keyed_rules(frequency: str, interval: int, pattern: Pattern, start: datetime) -> list[tuple[str, rr.rrule]]:
    """The rrules from aware `start`, each with the schedule key it comes from. Every by-value is
    explicit so that `replace(dtstart=...)` keeps it. Within one rrule, day lists intersect (and plain
    weekdays intersect nth ones), so each kind of day list gets a rule of its own."""
    p = pattern
    hours: tuple[int, ...] | None = p.hours or None  # None: every hour (only kept so for minute/hour)
    if hours is None and frequency in ("day", "week", "month"):
        hours = tuple(range(24)) if p.minutes else (start.hour,)
    minutes = p.minutes or (None if frequency == "minute" else (start.minute,))
    common: dict[str, Any] = {"freq": _FREQ[frequency], "interval": interval, "dtstart": start,
                              "wkst": rr.MO, "byhour": hours, "byminute": minutes, "bysecond": (0,)}
    if frequency == "week":
        return [("schedule.week_days", rr.rrule(byweekday=list(p.week_days) or [start.weekday()], **common))]
    if frequency != "month":
        return [("schedule", rr.rrule(**common))]
    rules = []
    if p.month_days or not p.monthly_occurrences:
        rules.append(("schedule.month_days", rr.rrule(bymonthday=p.month_days or (start.day,), **common)))
    every = [_RR_DAYS[day] for day, n in p.monthly_occurrences if n is None]
    nth = [_RR_DAYS[day](n) for day, n in p.monthly_occurrences if n is not None]
    rules += [("schedule.monthly_occurrences", rr.rrule(byweekday=days, **common)) for days in (every, nth) if days]
    return rules


def compile_rules(frequency: str, interval: int, pattern: Pattern, tz: ZoneInfo, start: datetime,
                  end: datetime | None, count: int | None) -> Rules:
    """`Rules` in zone `tz` from aware `start` (in `tz`) to aware `end` or `count` occurrences;
    raises ConfigValueError (keys relative to the recurrence) when it never occurs or ends before it begins."""
    try:
        keyed = _keyed_rules(frequency, interval, pattern, start)
        firsts = [(key, next(iter(rule), None)) for key, rule in keyed]
    except ValueError:  # rrule: the interval never lands on the hours/minutes
        raise ConfigValueError("schedule", f"never occurs: every {interval} {frequency}(s) from "
                               f"{start:%H:%M} never reaches the listed hours/minutes") from None
    for key, occurrence in firsts:
        if occurrence is None:  # also keeps every query from searching up to year 9999
            raise ConfigValueError(key, "never occurs: no period the interval reaches has such a day")
    rules = [rule for _, rule in keyed]
    first = min(occurrence for _, occurrence in firsts if occurrence is not None).astimezone(_UTC)
    until = end
    if count is not None:
        until = deque(itertools.islice(_union(rules), count), maxlen=1)[0].astimezone(_UTC)
    if until is not None:
        if first > until:
            raise ConfigValueError("end_time", f"is before the first occurrence ({iso_z(first)})")
        rules = [rule.replace(until=until) for rule in rules]
    wall = start.replace(tzinfo=None)
    return Rules(frequency, interval, tz, wall, _origin(frequency, wall), tuple(rules), first, until)


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
