"""Schedules: Azure Scheduler recurrences on dateutil.rrule, fixed dates, and the profile in force."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import yaml
from dateutil import rrule as rr
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agent.errors import ConfigValueError
from agent.policy.schedule import (
    DAYS,
    FREQUENCIES,
    MAX_INTERVAL,
    FixedDate,
    Recurrence,
    Selection,
    parse_fixed_date,
    parse_recurrence,
    select,
    validate_profiles,
)

UTC = UTC
WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday"]


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def rec(frequency: str, schedule: dict | None = None, **kw) -> Recurrence:
    return parse_recurrence({"frequency": frequency, **({"schedule": schedule} if schedule else {}), **kw})


def refused(value: dict) -> ConfigValueError:
    with pytest.raises(ConfigValueError) as info:
        parse_recurrence(value)
    return info.value


def days(occurrences: list[datetime]) -> list[str]:
    return [o.strftime("%Y-%m-%d %H:%M") for o in occurrences]


# --- the Azure Scheduler's documented examples ------------------------------------------------

def test_every_15_minutes_on_weekdays_between_9_and_16_45():
    """{minutes: [0,15,30,45], hours: [9..16], week_days: Mon-Fri} runs 32 times a weekday and skips the weekend."""
    r = rec("week", {"minutes": [0, 15, 30, 45], "hours": list(range(9, 17)), "week_days": WEEKDAYS})
    friday = r.occurrences_after(utc(2026, 1, 9, 0, 0), 40)  # Friday 2026-01-09
    assert days(friday[:2]) == ["2026-01-09 09:00", "2026-01-09 09:15"]
    assert days(friday[31:34]) == ["2026-01-09 16:45", "2026-01-12 09:00", "2026-01-12 09:15"]
    assert r.last_at_or_before(utc(2026, 1, 11, 12, 0)) == utc(2026, 1, 9, 16, 45)


def test_minutes_without_hours_run_every_hour():
    """As in the Scheduler's "every 15 minutes on weekdays" example, minutes without hours mean every hour."""
    r = rec("week", {"minutes": [0, 15, 30, 45], "week_days": WEEKDAYS})
    assert days(r.occurrences_after(utc(2026, 1, 9, 23, 40), 3)) == ["2026-01-09 23:45", "2026-01-12 00:00",
                                                                     "2026-01-12 00:15"]


def test_5_15_and_17_15_every_day():
    """{minutes: [15], hours: [5, 17]} with frequency day runs at 5:15 and 17:15."""
    r = rec("day", {"minutes": [15], "hours": [5, 17]})
    assert days(r.occurrences_after(utc(2026, 3, 1, 6, 0), 3)) == ["2026-03-01 17:15", "2026-03-02 05:15",
                                                                   "2026-03-02 17:15"]


def test_missing_hours_and_minutes_default_to_the_start_time():
    """Without hours and minutes a rule runs at the start time's; hours alone keep the start time's minute."""
    r = rec("week", {"week_days": ["sunday"]}, start_time="2026-01-01T10:30:00")
    assert days(r.occurrences_after(utc(2026, 1, 1), 2)) == ["2026-01-04 10:30", "2026-01-11 10:30"]
    r = rec("day", {"hours": [5]}, start_time="2026-01-01T10:30:00")
    assert days(r.occurrences_after(utc(2026, 1, 1), 2)) == ["2026-01-02 05:30", "2026-01-03 05:30"]


def test_last_friday_of_the_month():
    """monthly_occurrences {friday, -1} is the last Friday, whether the month has four or five."""
    r = rec("month", {"monthly_occurrences": [{"day": "Friday", "occurrence": -1}], "hours": [5], "minutes": [0]})
    assert days(r.occurrences_after(utc(2026, 1, 1), 4)) == ["2026-01-30 05:00", "2026-02-27 05:00",
                                                             "2026-03-27 05:00", "2026-04-24 05:00"]


def test_first_and_last_friday_and_third_from_the_end():
    """Several occurrences in one list, and negative ones other than -1."""
    r = rec("month", {"monthly_occurrences": [{"day": "friday", "occurrence": 1}, {"day": "friday", "occurrence": -1}]})
    assert [o.day for o in r.occurrences_after(utc(2026, 1, 1), 4)] == [2, 30, 6, 27]
    r = rec("month", {"monthly_occurrences": [{"day": "friday", "occurrence": -3}]})
    assert [o.day for o in r.occurrences_after(utc(2026, 1, 1), 2)] == [16, 13]


def test_every_wednesday_when_occurrence_is_omitted():
    """A monthly occurrence without `occurrence` means every such weekday of the month."""
    r = rec("month", {"monthly_occurrences": [{"day": "wednesday"}]})
    assert [o.day for o in r.occurrences_after(utc(2026, 1, 31), 5)] == [4, 11, 18, 25, 4]


def test_first_and_last_day_of_the_month():
    """month_days [1, -1] runs on the first and the last day, whatever the month's length."""
    r = rec("month", {"month_days": [1, -1], "hours": [6], "minutes": [0]})
    assert days(r.occurrences_after(utc(2026, 1, 15), 4)) == ["2026-01-31 06:00", "2026-02-01 06:00",
                                                              "2026-02-28 06:00", "2026-03-01 06:00"]


def test_day_31_skips_shorter_months():
    """month_days [31] only runs in months that have a 31st."""
    r = rec("month", {"month_days": [31]})
    assert [o.month for o in r.occurrences_after(utc(2026, 1, 1), 4)] == [1, 3, 5, 7]


def test_fifth_friday_is_skipped_in_months_without_one():
    """{friday, 5} runs only in months with five Fridays."""
    r = rec("month", {"monthly_occurrences": [{"day": "friday", "occurrence": 5}]})
    assert days(r.occurrences_after(utc(2026, 1, 1), 5)) == ["2026-01-30 00:00", "2026-05-29 00:00",
                                                             "2026-07-31 00:00", "2026-10-30 00:00",
                                                             "2027-01-29 00:00"]


def test_month_days_with_monthly_occurrences_is_a_union():
    """month_days and monthly_occurrences together run on either (a single rrule would intersect them)."""
    r = rec("month", {"month_days": [15], "monthly_occurrences": [{"day": "friday", "occurrence": -1}]})
    assert [o.day for o in r.occurrences_after(utc(2026, 1, 1), 4)] == [15, 30, 15, 27]


@pytest.mark.parametrize("start", ["2015-04-07T14:00:00", "2015-04-05T14:00:00", "2015-04-01T14:00:00"])
def test_past_start_time_yields_the_first_future_occurrence(start):
    """Every 2 days from a past start: at 04-08 13:00 the next run is 04-09 14:00, then every 2 days (Azure docs)."""
    r = rec("day", interval=2, start_time=start)
    assert days(r.occurrences_after(utc(2015, 4, 8, 13, 0), 3)) == ["2015-04-09 14:00", "2015-04-11 14:00",
                                                                    "2015-04-13 14:00"]


def test_count_counts_from_the_start_time():
    """Daily with count 5 from a Monday ends after Friday; its last occurrence stays the latest one."""
    r = rec("day", count=5, start_time="2026-01-05T09:00:00")
    assert len(r.occurrences_after(utc(2026, 1, 1), 10)) == 5
    assert r.next_after(utc(2026, 1, 9, 9, 0)) is None
    assert r.last_at_or_before(utc(2027, 1, 1)) == utc(2026, 1, 9, 9, 0)


def test_end_time_is_inclusive():
    """An occurrence exactly at end_time still happens; none after it."""
    r = rec("day", start_time="2026-01-05T09:00:00", end_time="2026-01-07T09:00:00")
    assert days(r.occurrences_after(utc(2026, 1, 1), 10)) == ["2026-01-05 09:00", "2026-01-06 09:00",
                                                              "2026-01-07 09:00"]
    assert r.next_after(utc(2026, 1, 7, 9, 0)) is None


# --- time zones and DST -----------------------------------------------------------------------

def test_01_00_stockholm_is_00_00z_in_winter_and_23_00z_the_day_before_in_summer():
    """A 01:00 Europe/Stockholm daily window keeps its wall-clock time across DST."""
    r = rec("day", {"hours": [1], "minutes": [0]}, time_zone="Europe/Stockholm")
    assert r.next_after(utc(2026, 1, 10, 12, 0)) == utc(2026, 1, 11, 0, 0)
    assert r.next_after(utc(2026, 7, 10, 12, 0)) == utc(2026, 7, 10, 23, 0)
    assert r.last_at_or_before(utc(2026, 7, 10, 22, 59)) == utc(2026, 7, 9, 23, 0)


def test_wall_time_skipped_by_dst_falls_after_the_gap_and_a_repeated_one_happens_once():
    """02:30 Stockholm happens at 03:30 CEST on 2026-03-29 (not a day later) and once, in CEST, on 2026-10-25."""
    r = rec("day", {"hours": [2], "minutes": [30]}, time_zone="Europe/Stockholm")
    assert r.next_after(utc(2026, 3, 29, 1, 15)) == utc(2026, 3, 29, 1, 30)
    assert r.last_at_or_before(utc(2026, 3, 29, 1, 45)) == utc(2026, 3, 29, 1, 30)
    assert r.occurrences_after(utc(2026, 10, 24, 12, 0), 2) == [utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]


def test_times_without_offset_are_wall_clock_in_the_time_zone():
    """YAML timestamps, dates and ISO strings are accepted; naive ones are read in time_zone."""
    value = yaml.safe_load("frequency: day\nstart_time: 2026-01-05T09:00:00\ntime_zone: Europe/Stockholm\n"
                           "end_time: 2026-01-08\n")
    assert isinstance(value["start_time"], datetime)
    r = parse_recurrence(value)
    assert r.occurrences_after(utc(2026, 1, 1), 5) == [utc(2026, 1, 5, 8), utc(2026, 1, 6, 8), utc(2026, 1, 7, 8)]
    r = parse_recurrence(yaml.safe_load("frequency: day\nstart_time: 2026-01-05T09:00:00Z\n"
                                        "time_zone: Europe/Stockholm"))
    assert r.next_after(utc(2026, 6, 1)) == utc(2026, 6, 1, 8)  # 10:00 local, the start's wall-clock hour


# --- config errors ----------------------------------------------------------------------------

def test_count_and_end_time_exclude_each_other():
    """count and end_time together are refused at end_time."""
    err = refused({"frequency": "day", "start_time": "2026-01-01T00:00:00", "count": 3, "end_time": "2026-02-01"})
    assert err.key == "end_time" and "count" in err.message


def test_count_needs_a_start_time():
    """count without start_time would count from 2000-01-01, so it is refused."""
    assert refused({"frequency": "day", "count": 3}).key == "count"


def test_end_time_must_follow_start_time_and_leave_an_occurrence():
    """end_time at or before start_time, or before the first occurrence, is refused."""
    assert refused({"frequency": "day", "start_time": "2026-01-05", "end_time": "2026-01-05"}).key == "end_time"
    err = refused({"frequency": "day", "schedule": {"hours": [10]}, "start_time": "2026-01-05T09:00:00",
                   "end_time": "2026-01-05T09:30:00"})
    assert err.key == "end_time" and "first occurrence" in err.message


@pytest.mark.parametrize("frequency", FREQUENCIES)
def test_interval_bounds(frequency):
    """Intervals up to the Scheduler's limit (minute/hour 1000, day 548, week 78, month 18) pass;
    one more is refused."""
    extra = {"schedule": {"week_days": ["monday"]}} if frequency == "week" else {}
    rec(frequency, interval=MAX_INTERVAL[frequency], **extra)
    err = refused({"frequency": frequency, "interval": MAX_INTERVAL[frequency] + 1, **extra})
    assert err.key == "interval" and str(MAX_INTERVAL[frequency]) in err.message
    assert refused({"frequency": frequency, "interval": 0}).key == "interval"


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("week_days", ["monday"], "week"),
    ("month_days", [1], "month"),
    ("monthly_occurrences", [{"day": "monday", "occurrence": 1}], "month"),
])
def test_day_lists_only_with_their_frequency(key, value, allowed):
    """week_days only with frequency week; month_days and monthly_occurrences only with month."""
    for frequency in FREQUENCIES:
        if frequency == allowed:
            rec(frequency, {key: value})
        else:
            err = refused({"frequency": frequency, "schedule": {key: value}})
            assert err.key == f"schedule.{key}" and allowed in err.message


@pytest.mark.parametrize("occurrence", [0, 6, -6, "last"])
def test_occurrence_out_of_range(occurrence):
    """An occurrence outside ±1..5 is refused at its own key."""
    err = refused({"frequency": "month",
                   "schedule": {"monthly_occurrences": [{"day": "friday", "occurrence": occurrence}]}})
    assert err.key == "schedule.monthly_occurrences[0].occurrence"


def test_unknown_time_zone():
    """A time zone that is not an IANA name is refused, with a suggestion when one is close."""
    err = refused({"frequency": "day", "time_zone": "Europe/Stokholm"})
    assert err.key == "time_zone" and "Europe/Stockholm" in err.message
    assert refused({"frequency": "day", "time_zone": "Mars/Olympus"}).key == "time_zone"
    with pytest.raises(ConfigValueError) as info:
        parse_fixed_date({"start": "2026-01-01", "end": "2026-01-02", "time_zone": "Nowhere"})
    assert info.value.key == "time_zone"


def test_errors_name_the_offending_value():
    """Bad list items, day names, month days and unknown keys are reported at their own keys."""
    assert refused({"frequency": "day", "schedule": {"hours": [9, 24]}}).key == "schedule.hours[1]"
    err = refused({"frequency": "week", "schedule": {"week_days": ["monday", "fri"]}})
    assert err.key == "schedule.week_days[1]" and "friday" in err.message
    assert refused({"frequency": "month", "schedule": {"month_days": [0]}}).key == "schedule.month_days[0]"
    err = refused({"frequency": "week", "schedule": {"weekDays": ["monday"]}})
    assert err.key == "schedule.weekDays" and "week_days" in err.message
    assert refused({"frequency": "weekly"}).key == "frequency"
    assert refused({"frequency": "day", "start_time": "next monday"}).key == "start_time"


def test_weekly_rule_needs_week_days_or_a_start_time():
    """frequency week with neither week_days nor start_time is refused (it would fall on Saturdays)."""
    assert refused({"frequency": "week"}).key == "schedule.week_days"
    assert rec("week", start_time="2026-01-05T09:00:00").next_after(utc(2026, 1, 6)) == utc(2026, 1, 12, 9)


def test_schedules_that_never_occur_are_refused():
    """An interval that never lands on the listed hours, or on a listed day, is a config error."""
    err = refused({"frequency": "hour", "interval": 2, "schedule": {"hours": [1]}})
    assert err.key == "schedule" and "never" in err.message
    err = refused({"frequency": "minute", "interval": 120, "schedule": {"hours": [1]}})
    assert err.key == "schedule" and "never" in err.message
    err = refused({"frequency": "month", "interval": 12, "start_time": "2026-02-01", "schedule": {"month_days": [30]}})
    assert err.key == "schedule.month_days" and "never" in err.message


# --- behaviour of the Recurrence object -------------------------------------------------------

def test_queries_far_from_the_start_time_do_not_iterate_from_it():
    """Every 7 minutes from 2000-01-01 answers in 2026 at once, keeping the interval's phase."""
    r = rec("minute", interval=7)
    now = utc(2026, 6, 1, 12, 0, 30)
    step = timedelta(minutes=7)
    expected_last = utc(2000, 1, 1) + ((now - utc(2000, 1, 1)) // step) * step
    assert r.last_at_or_before(now) == expected_last
    assert r.next_after(now) == expected_last + step
    assert r.occurrences_after(now, 2) == [expected_last + step, expected_last + 2 * step]


def test_naive_times_are_rejected():
    """Queries need timezone-aware instants."""
    r = rec("day")
    with pytest.raises(ValueError):
        r.next_after(datetime(2026, 1, 1))
    with pytest.raises(ValueError):
        select([r, None], datetime(2026, 1, 1))


def test_recurrences_compare_and_hash_by_value():
    """Equal configs give equal, hashable recurrences; a different one is unequal."""
    a = rec("day", {"hours": [1]}, time_zone="Europe/Stockholm")
    b = rec("day", {"hours": [1]}, time_zone="Europe/Stockholm")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != rec("day", {"hours": [2]}, time_zone="Europe/Stockholm")


# --- fixed dates ------------------------------------------------------------------------------

def test_fixed_date_is_start_inclusive_end_exclusive_in_utc():
    """start/end without an offset are read in time_zone and stored in UTC; end is exclusive."""
    window = parse_fixed_date({"start": "2026-12-20T00:00:00", "end": yaml.safe_load("2027-01-04"),
                               "time_zone": "Europe/Stockholm"})
    assert window == FixedDate(utc(2026, 12, 19, 23, 0), utc(2027, 1, 3, 23, 0))
    assert window.contains(utc(2026, 12, 19, 23, 0)) and not window.contains(utc(2027, 1, 3, 23, 0))
    aware = parse_fixed_date(yaml.safe_load("{start: 2026-12-20T00:00:00Z, end: 2027-01-04T00:00:00Z}"))
    assert aware.start == utc(2026, 12, 20)


def test_fixed_date_must_end_after_it_starts():
    """A window that ends before it starts, or lacks an end, is refused at that key."""
    with pytest.raises(ConfigValueError) as info:
        parse_fixed_date({"start": "2026-12-20", "end": "2026-12-19"})
    assert info.value.key == "end"
    with pytest.raises(ConfigValueError):
        parse_fixed_date({"start": "2026-12-20"})


# --- profile selection ------------------------------------------------------------------------

NIGHTS = rec("day", {"hours": [1], "minutes": [0]}, time_zone="Europe/Stockholm")
DAYTIME = rec("day", {"hours": [7], "minutes": [0]}, time_zone="Europe/Stockholm")
FREEZE = FixedDate(utc(2026, 12, 20), utc(2027, 1, 4))


def test_fixed_date_beats_recurrence_beats_default():
    """Whatever the list order: a fixed date containing now wins, then a recurrence that has
    occurred, then the default."""
    future = rec("day", start_time="2030-01-01T00:00:00")
    schedules = [None, future, NIGHTS, FREEZE]
    assert select(schedules, utc(2026, 12, 24)) == Selection(3, FREEZE.start, FREEZE.end)
    assert select(schedules, utc(2026, 6, 1, 12)).index == 2
    assert select([None, future], utc(2026, 6, 1)) == Selection(0, None, utc(2030, 1, 1))


def test_nights_and_days_alternate():
    """Two daily recurrences at 01:00 and 07:00 local take turns; each reports when it began and the next switch."""
    schedules = [NIGHTS, DAYTIME, None]
    assert select(schedules, utc(2026, 1, 10, 3)) == Selection(0, utc(2026, 1, 10, 0), utc(2026, 1, 10, 6))
    assert select(schedules, utc(2026, 1, 10, 12)) == Selection(1, utc(2026, 1, 10, 6), utc(2026, 1, 11, 0))
    assert select(schedules, utc(2026, 7, 10, 23, 30)) == Selection(0, utc(2026, 7, 10, 23), utc(2026, 7, 11, 5))


def test_since_is_when_the_profile_took_over_not_its_latest_occurrence():
    """Nightly windows in a row keep `since` at the first night after the other profile last occurred."""
    mondays = rec("week", {"week_days": ["monday"], "hours": [7], "minutes": [0]}, time_zone="Europe/Stockholm")
    sel = select([NIGHTS, mondays, None], utc(2026, 1, 15, 12))  # Thursday
    assert sel == Selection(0, utc(2026, 1, 13, 0), utc(2026, 1, 19, 6))


def test_next_change_includes_an_upcoming_fixed_date_and_since_a_past_one():
    """Before a freeze its start is the next change; after it the recurrence resumes, and its own
    occurrences are no change."""
    weekly = rec("week", {"week_days": ["monday"], "hours": [7], "minutes": [0]}, time_zone="UTC")
    schedules = [FREEZE, weekly, None]
    assert select(schedules, utc(2026, 12, 19, 12)).next_change == FREEZE.start
    assert select(schedules, utc(2027, 1, 4, 12)) == Selection(1, FREEZE.end, None)


def test_an_earlier_listed_fixed_date_takes_over_inside_a_later_one():
    """Overlapping fixed dates: the first listed wins, so the later one's next change is the earlier one's start."""
    inner = FixedDate(utc(2026, 12, 24), utc(2026, 12, 27))
    schedules = [inner, FREEZE, None]
    assert select(schedules, utc(2026, 12, 21)) == Selection(1, FREEZE.start, inner.start)
    assert select(schedules, utc(2026, 12, 25)) == Selection(0, inner.start, inner.end)
    assert select(schedules, utc(2026, 12, 28)) == Selection(1, inner.end, FREEZE.end)


def test_nothing_applies_gives_minus_one():
    """Without a default, before any recurrence has occurred and outside fixed dates, the index is -1."""
    assert select([FREEZE], utc(2026, 1, 1)) == Selection(-1, None, FREEZE.start)
    assert select([], utc(2026, 1, 1)) == Selection(-1, None, None)


def test_equal_instants_go_to_the_first_listed():
    """Two recurrences occurring at the same instant: the first listed is in force."""
    twin = rec("day", {"hours": [1], "minutes": [0]}, time_zone="Europe/Stockholm")
    assert select([DAYTIME, twin, NIGHTS, None], utc(2026, 1, 10, 3)).index == 1


def test_an_ended_recurrence_stays_in_force_until_another_occurs():
    """After its last occurrence a recurrence profile's window lasts until another recurrence profile occurs."""
    once = rec("day", count=1, start_time="2026-01-05T09:00:00")
    assert select([once, None], utc(2026, 6, 1)) == Selection(0, utc(2026, 1, 5, 9), None)


def test_validate_profiles_wants_exactly_one_default():
    """No default or a second default is refused; the second one is named by its index."""
    validate_profiles([FREEZE, NIGHTS, None])
    with pytest.raises(ConfigValueError) as info:
        validate_profiles([FREEZE, NIGHTS])
    assert info.value.key == "" and "default" in info.value.message
    with pytest.raises(ConfigValueError) as info:
        validate_profiles([None, NIGHTS, None])
    assert info.value.key == "[2]" and "[0]" in info.value.message


# --- properties -------------------------------------------------------------------------------

ZONES = ("UTC", "Europe/Stockholm", "America/New_York", "Australia/Sydney")
HORIZON_UNIT = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1),
                "week": timedelta(weeks=1), "month": timedelta(days=31)}


@st.composite
def recurrence_configs(draw: st.DrawFn, frequencies: tuple[str, ...] = FREQUENCIES, minute: int | None = None) -> dict:
    frequency = draw(st.sampled_from(frequencies))
    limit = {"minute": 90, "hour": 30, "day": 40, "week": 10, "month": 18}[frequency]
    schedule: dict = {}
    small = st.lists(st.integers(0, 23), min_size=1, max_size=3, unique=True)
    if draw(st.booleans()):
        schedule["hours"] = draw(small)
    if minute is not None:
        schedule["minutes"] = [minute]
    elif draw(st.booleans()):
        schedule["minutes"] = draw(st.lists(st.integers(0, 59), min_size=1, max_size=3, unique=True))
    if frequency == "week":
        schedule["week_days"] = draw(st.lists(st.sampled_from(DAYS), min_size=1, max_size=3, unique=True))
    if frequency == "month" and draw(st.booleans()):
        schedule["month_days"] = draw(st.lists(st.integers(-31, 31).filter(bool), min_size=1, max_size=3, unique=True))
    if frequency == "month" and draw(st.booleans()):
        some_days = st.lists(st.sampled_from(DAYS), min_size=1, max_size=2, unique=True)
        schedule["monthly_occurrences"] = [{"day": d, "occurrence": draw(st.sampled_from([None, 1, 2, 5, -1, -2]))}
                                           for d in draw(some_days)]
    config = {"frequency": frequency, "interval": draw(st.integers(1, limit)), "schedule": schedule,
              "time_zone": draw(st.sampled_from(ZONES)),
              "start_time": draw(st.datetimes(datetime(2024, 1, 1), datetime(2027, 1, 1))).isoformat()}
    ending = draw(st.sampled_from(["none", "count", "end_time"]))
    if ending == "count":
        config["count"] = draw(st.integers(1, 50))
    elif ending == "end_time":
        config["end_time"] = draw(st.datetimes(datetime(2027, 1, 2), datetime(2040, 1, 1))).isoformat()
    return config


def build(config: dict) -> Recurrence:
    try:
        return parse_recurrence(config)
    except ConfigValueError:
        assume(False)
        raise


@settings(max_examples=150, deadline=None)
@given(recurrence_configs(), st.floats(0, 1))
def test_restarted_rules_match_iterating_from_the_start_time(config, fraction):
    """Queries that restart the rules near the instant give what plain rrule iteration from start_time gives."""
    r = build(config)
    reference = rr.rruleset()
    for rule in r._compiled.rules:
        reference.rrule(rule)
    start = r.occurrences_after(datetime(2023, 1, 1, tzinfo=UTC), 1)[0]
    span = 200 * r.interval * HORIZON_UNIT[r.frequency] + timedelta(days=3)
    t = start - timedelta(hours=2) + span * fraction
    expected_last, expected_next = reference.before(t, inc=True), reference.after(t)
    assert r.last_at_or_before(t) == (expected_last and expected_last.astimezone(UTC))
    assert r.next_after(t) == (expected_next and expected_next.astimezone(UTC))
    if expected_next is not None:
        assert r.occurrences_after(t, 1) == [expected_next.astimezone(UTC)]


@st.composite
def profile_lists(draw: st.DrawFn) -> list:
    count = draw(st.integers(0, 3))
    # distinct minutes keep recurrences from sharing an instant (the zones' offsets are whole hours)
    schedules: list = [build(draw(recurrence_configs(("hour", "day", "week", "month"), minute=7 * k + 1)))
                       for k in range(count)]
    for _ in range(draw(st.integers(0, 2))):
        start = draw(st.datetimes(datetime(2025, 6, 1), datetime(2027, 6, 1), timezones=st.just(UTC)))
        schedules.append(FixedDate(start, start + draw(st.timedeltas(timedelta(minutes=1), timedelta(days=40)))))
    if draw(st.booleans()):
        schedules.append(None)
    return draw(st.permutations(schedules))


@settings(max_examples=150, deadline=None)
@given(profile_lists(), st.datetimes(datetime(2026, 1, 1), datetime(2027, 1, 1), timezones=st.just(UTC)),
       st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=4))
def test_selection_holds_from_since_until_next_change(schedules, now, fractions):
    """next_change is after now and nothing changes before it; since is when the selection began."""
    sel = select(schedules, now)
    assert sel.next_change is None or sel.next_change > now
    end = sel.next_change or now + timedelta(days=400)
    for fraction in fractions:
        t = now + (end - now) * fraction
        if t < end:
            assert select(schedules, t).index == sel.index
    if sel.since is not None:
        assert sel.since <= now
        assert select(schedules, sel.since).index == sel.index
        assert select(schedules, sel.since - timedelta(microseconds=1)).index != sel.index
