"""The one reader of instants (`agent.model.timefmt`): each variant its callers need, on what an operator, a
peer or a store may write."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone

import pytest

from agent.model.timefmt import (
    MAX_CHARS,
    aware_or_none,
    instant_or_none,
    iso_z,
    optional_aware,
    optional_iso,
    parse_aware,
    parse_day,
    parse_iso,
    parse_iso_utc,
    since_instant,
)

AT = datetime(2026, 11, 27, 0, 18, 5, tzinfo=UTC)
JUNK = ("", "soon", "2026-13-01T00:00:00Z", "2026-11-27T25:00:00Z", "2026-11-27T00:00:00+99:00")


def test_what_iso_z_writes_reads_back_as_the_same_instant() -> None:
    assert iso_z(AT) == "2026-11-27T00:18:05Z"
    for read in (parse_iso, parse_iso_utc, parse_aware, optional_iso, optional_aware, instant_or_none):
        assert read(iso_z(AT)) == AT
    assert parse_iso("2026-11-27T01:18:05+01:00") == AT


def test_parse_iso_keeps_a_time_without_an_offset_naive_for_the_callers_wall_clock() -> None:
    assert parse_iso("2026-01-05T09:00:00") == datetime(2026, 1, 5, 9, 0)
    assert parse_iso("2026-01-05T09:00:00").tzinfo is None


@pytest.mark.parametrize("text", JUNK)
def test_the_raising_readers_refuse_junk_with_a_value_error(text: str) -> None:
    for read in (parse_iso, parse_iso_utc, parse_aware):
        with pytest.raises(ValueError):
            read(text)


def test_parse_iso_utc_reads_a_time_without_an_offset_as_utc() -> None:
    assert parse_iso_utc("2026-11-27T00:18:05") == AT
    assert parse_iso_utc("2026-11-27T02:18:05+02:00").utcoffset() == timedelta(hours=2)


def test_parse_aware_requires_an_offset() -> None:
    with pytest.raises(ValueError, match="offset"):
        parse_aware("2026-11-27T00:18:05")
    assert parse_aware("2026-11-27T00:18:05-05:00").tzinfo == timezone(timedelta(hours=-5))


def test_the_optional_readers_give_none_for_no_text_and_refuse_junk_text() -> None:
    for read in (optional_iso, optional_aware):
        for nothing in ("", None, 17, ["2026-11-27T00:18:05Z"]):
            assert read(nothing) is None
        with pytest.raises(ValueError):
            read("soon")
    assert optional_iso("2026-11-27T00:18:05") == datetime(2026, 11, 27, 0, 18, 5)
    with pytest.raises(ValueError):
        optional_aware("2026-11-27T00:18:05")


@pytest.mark.parametrize("value", [*JUNK, None, 17, 1.5, AT, b"2026-11-27T00:18:05Z", "2026-11-27T00:18:05",
                                   "2026-11-27T00:18:05Z" + " " * MAX_CHARS, "9" * 10_000])
def test_instant_or_none_never_raises_and_gives_none_for_anything_but_an_instant_with_an_offset(value: object) -> None:
    assert instant_or_none(value) is None


def test_instant_or_none_reads_the_longest_instant_maintd_writes() -> None:
    longest = "2026-11-27T00:18:05.123456+00:00"
    assert len(longest) <= MAX_CHARS and instant_or_none(longest) == AT.replace(microsecond=123456)


def test_aware_or_none_keeps_only_a_datetime_with_an_offset() -> None:
    assert aware_or_none(AT) is AT
    for value in (AT.replace(tzinfo=None), "2026-11-27T00:18:05Z", None, 0):
        assert aware_or_none(value) is None


def test_parse_day_reads_a_folder_s_day_and_refuses_junk() -> None:
    assert parse_day("2026-11-27") == date(2026, 11, 27)
    for text in ("2026-11-31", "today", ""):
        with pytest.raises(ValueError):
            parse_day(text)


def test_since_names_a_span_back_from_now_or_an_instant_utc_when_naive() -> None:
    assert since_instant("2h", AT) == AT - timedelta(hours=2)
    assert since_instant(" 2026-11-27T00:18:05 ", AT) == AT
    with pytest.raises(ValueError, match="neither a span"):
        since_instant("soon", AT)
