"""How maintd writes and reads instants: ISO 8601 in UTC with a `Z` (what the API, hooks, webhooks,
the state file and the journal show), one spelling everywhere."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from agent.model.config_schema import parse_duration_text


def iso_z(t: datetime) -> str:
    """`t` as ISO 8601 with `Z` for UTC (`2026-09-19T18:29:47Z`)."""
    return t.isoformat().replace("+00:00", "Z")


def iso_z_or_none(t: datetime | None) -> str | None:
    """`iso_z(t)`, or None when there is no instant."""
    return iso_z(t) if t is not None else None


def parse_iso(text: str) -> datetime:
    """An instant written by `iso_z` (or any ISO 8601 with an offset); ValueError otherwise."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def since_instant(value: str, now: datetime) -> datetime:
    """The instant `--since` names: a span back from `now` (`7d`, `2h`, `30m`, `90s`, `PT1H`) or an ISO 8601 time
    (`2026-11-27T00:00:00Z`; without an offset, UTC); ValueError otherwise."""
    try:
        return now - timedelta(seconds=parse_duration_text(value))
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{value!r} is neither a span (7d, 2h, 30m) nor an ISO 8601 time (2026-11-27T00:00Z)") \
            from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)
