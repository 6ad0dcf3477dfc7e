"""One reading of HTTP dates and Retry-After for IMDS, webhooks and the store (issue 28, LOW 8): whatever a
header holds, an answer or None, never an exception."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.net.httpdates import parse_http_date, retry_after, transient_status

NOW = datetime(2026, 1, 1, tzinfo=UTC)


@given(st.text(max_size=60))
def test_any_header_text_gives_an_answer_or_none(value):
    """Never a raise, never more than the cap, never negative."""
    seconds = retry_after(value, NOW, 300.0)
    assert seconds is None or 0.0 <= seconds <= 300.0
    when = parse_http_date(value)
    assert when is None or when.tzinfo is not None


def test_the_three_date_forms_and_zoneless_dates_are_utc():
    """IMF-fixdate, RFC 850, asctime: the same instant; a date without a zone is read as UTC."""
    for value in ("Thu, 01 Jan 2026 00:00:30 GMT", "Thursday, 01-Jan-26 00:00:30 GMT", "Thu Jan  1 00:00:30 2026",
                  "Thu, 01 Jan 2026 00:00:30 -0000"):
        assert parse_http_date(value) == datetime(2026, 1, 1, 0, 0, 30, tzinfo=UTC), value
    assert parse_http_date("Thu, 01 Jan 2026 99:00:30 GMT") is None and parse_http_date(None) is None


def test_transient_statuses():
    """Asked again later: 408, 429 and 5xx; never a 4xx the request itself caused, nor a nonsense status."""
    assert [s for s in (200, 304, 400, 401, 404, 408, 429, 500, 503, 599, 600, 999) if transient_status(s)] == \
        [408, 429, 500, 503, 599]


def test_the_stores_clock_survives_a_malformed_date_header():
    """A Date the store's answer carries that is no date (a proxy's, a fault's): the local clock, no ValueError."""
    pytest.importorskip("azure.storage.blob")
    from agent.coordination.store.blob_store import _server_time

    assert _server_time({"Date": "not a date"}, NOW) == NOW
    assert _server_time({"Date": "Thu, 01 Jan 2026 00:00:30 GMT"}, NOW) == datetime(2026, 1, 1, 0, 0, 30, tzinfo=UTC)
