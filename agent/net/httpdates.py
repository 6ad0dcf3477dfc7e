"""HTTP's dates and its Retry-After, read one way by every client (IMDS, webhooks, the store): strict, capped,
and never raising, whatever the header holds.

- `parse_http_date`: an HTTP-date (IMF-fixdate, and the obsolete RFC 850 and asctime forms `email.utils`
  reads) as an aware datetime in UTC; None when it is not one.
- `retry_after`: the seconds a Retry-After asks for. Delta-seconds are ASCII digits only: `str.isdigit` also
  passes `²` and `١٢`, which `float` then refuses with a ValueError. Anything else must be an HTTP-date (one
  in the past is 0). At most `cap`, so a hostile or broken answer asking for a day (or 5000 nines) cannot stop
  the client for longer; None when absent or unreadable.
- `transient_status`: a status worth another try later (408, 429 and 5xx).
"""

from __future__ import annotations

import email.utils
from datetime import UTC, datetime


def parse_http_date(value: str | None) -> datetime | None:
    """`value` as an aware UTC datetime when it is an HTTP-date (a date without a zone is read as UTC); else None."""
    text = (value or "").strip()
    if not text or not text.isascii():
        return None
    try:
        when = email.utils.parsedate_to_datetime(text)
        return (when if when.tzinfo else when.replace(tzinfo=UTC)).astimezone(UTC)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def retry_after(value: str | None, now: datetime, cap: float) -> float | None:
    """Seconds from a Retry-After header, at most `cap`; None when absent or neither ASCII digits nor an HTTP-date."""
    text = (value or "").strip()
    if text.isascii() and text.isdigit():
        return min(float(text), cap)
    when = parse_http_date(text)
    if when is None:
        return None
    return min(max(0.0, (when - now).total_seconds()), cap)


def transient_status(status: int) -> bool:
    """Whether an answer of `status` may succeed if asked again later: a timeout, throttling or a server error."""
    return status in (408, 429) or 500 <= status <= 599
