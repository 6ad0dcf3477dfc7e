"""How maintd writes and reads instants: ISO 8601 in UTC with a `Z` (what the API, hooks, webhooks,
the state file and the journal show), one spelling everywhere, and the one place that parses them.

Every reader of an instant outside this module calls one of these (the project test
`tests/project/test_words.py` holds it):

- `parse_iso`: ISO 8601, an offset optional (a naive result is the caller's wall clock); ValueError otherwise.
- `parse_iso_utc`: the same, a time without an offset read as UTC.
- `parse_aware`: the same, an offset required.
- `optional_iso`, `optional_aware`: None when there is no text (not a str, or ""), else `parse_iso`, `parse_aware`.
- `instant_or_none`: an instant with an offset from anything a peer or a store wrote (at most `MAX_CHARS`
  characters); None for anything else, never an exception.
- `aware_or_none`: a datetime that carries an offset, else None (a listing's Last-Modified).
- `parse_day`: a day (`2026-11-27`), as the fleet history's folders name it.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Final

from agent.model.config_schema import parse_duration_text

MAX_CHARS: Final = 64
"""The longest text `instant_or_none` reads: `iso_z` writes at most 27 characters, an offset and microseconds
make 32; anything longer is not an instant maintd wrote."""


def iso_z(t: datetime) -> str:
    """`t` as ISO 8601 with `Z` for UTC (`2026-09-19T18:29:47Z`)."""
    return t.isoformat().replace("+00:00", "Z")


def iso_z_or_none(t: datetime | None) -> str | None:
    """`iso_z(t)`, or None when there is no instant."""
    return iso_z(t) if t is not None else None


def parse_iso(text: str) -> datetime:
    """An instant written by `iso_z` (or any ISO 8601, with an offset or without: then naive); ValueError
    otherwise."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def parse_iso_utc(text: str) -> datetime:
    """`parse_iso(text)`, a time without an offset read as UTC; ValueError otherwise."""
    t = parse_iso(text)
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def parse_aware(text: str) -> datetime:
    """`parse_iso(text)` when it gives an offset; ValueError otherwise (a naive time included)."""
    t = parse_iso(text)
    if t.tzinfo is None:
        raise ValueError("an instant without an offset")
    return t


def optional_iso(value: object) -> datetime | None:
    """None when there is no text (`value` not a str, or ""); else `parse_iso(value)` (ValueError for text that is
    not an instant)."""
    return parse_iso(value) if isinstance(value, str) and value else None


def optional_aware(value: object) -> datetime | None:
    """None when there is no text (`value` not a str, or ""); else `parse_aware(value)` (ValueError for text that is
    not an instant with an offset)."""
    return parse_aware(value) if isinstance(value, str) and value else None


def instant_or_none(value: object) -> datetime | None:
    """An instant with an offset when `value` is ISO 8601 text of at most MAX_CHARS characters; None otherwise
    (not a str, junk, no offset), never an exception."""
    if not isinstance(value, str) or len(value) > MAX_CHARS:
        return None
    try:
        t = parse_iso(value)
    except ValueError:
        return None
    return t if t.utcoffset() is not None else None


def aware_or_none(value: object) -> datetime | None:
    """`value` when it is a datetime with an offset; None otherwise."""
    return value if isinstance(value, datetime) and value.utcoffset() is not None else None


def parse_day(text: str) -> date:
    """A day in ISO 8601 (`2026-11-27`); ValueError otherwise."""
    return date.fromisoformat(text)


def since_instant(value: str, now: datetime) -> datetime:
    """The instant `--since` names: a span back from `now` (`7d`, `2h`, `30m`, `90s`, `PT1H`) or an ISO 8601 time
    (`2026-11-27T00:00:00Z`; without an offset, UTC); ValueError otherwise."""
    try:
        return now - timedelta(seconds=parse_duration_text(value))
    except ValueError:
        pass
    try:
        return parse_iso_utc(value.strip())
    except ValueError:
        raise ValueError(f"{value!r} is neither a span (7d, 2h, 30m) nor an ISO 8601 time (2026-11-27T00:00Z)") \
            from None
