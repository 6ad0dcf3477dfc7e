"""The IMDS client against `responses`: headers, proxies, status handling, ETag, backoff."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import requests
import responses
from responses import matchers

from agent.addressing import Identity
from agent.errors import ImdsRequestRejected, ImdsUnavailable
from agent.imds import ImdsClient, next_poll_delay, parse_retry_after
from agent.metrics import Metrics

BASE = "http://169.254.169.254"
SE = f"{BASE}/metadata/scheduledevents"
DOC = {"DocumentIncarnation": 1, "Events": []}
JSON = {"Content-Type": "application/json; charset=utf-8"}


@pytest.fixture
def imds():
    with responses.RequestsMock(assert_all_requests_are_fired=True) as rsps:
        yield rsps


@pytest.fixture
def client(clock):
    return ImdsClient(BASE, "2020-07-01", timeout=2, first_timeout=120, compute_api_version="2021-02-01",
                      clock=clock, metrics=Metrics())


def _get(imds, status=200, json=DOC, headers=None, **kw):
    return imds.get(SE, status=status, json=json, headers={**JSON, **(headers or {})}, **kw)


def test_poll_sends_metadata_header_and_api_version(imds, client):
    """Every poll carries `Metadata: true` and api-version=2020-07-01, and nothing is retried."""
    imds.get(SE, json=DOC, headers=JSON, match=[matchers.header_matcher({"Metadata": "true"}),
                                                matchers.query_param_matcher({"api-version": "2020-07-01"})])
    result = client.get_document()
    assert result.document is not None and result.document.incarnation == 1


def test_proxy_variables_are_ignored(imds, client, monkeypatch):
    """HTTP_PROXY in the environment must not route IMDS calls through a proxy."""
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    _get(imds)
    client.get_document()
    assert client.session.trust_env is False
    assert imds.calls[0].request.url.startswith(BASE)
    assert not client.session.proxies.get("http")


def test_first_call_uses_the_long_timeout_then_the_short_one(imds, client, monkeypatch):
    """IMDS may take two minutes to answer the first request; later polls use imds.timeout."""
    seen = []
    real = client.session.request

    def spy(*args, **kwargs):
        seen.append(kwargs["timeout"][1])
        return real(*args, **kwargs)

    monkeypatch.setattr(client.session, "request", spy)
    _get(imds)
    _get(imds)
    client.get_document()
    client.get_document()
    assert seen == [120, 2]


@pytest.mark.parametrize("status", [400, 405])
def test_400_and_405_mean_the_request_is_wrong(imds, client, status):
    """400/405 are ImdsRequestRejected, with IMDS's body kept for the log."""
    body = {"error": "Bad request. Required metadata header not specified"}
    _get(imds, status=status, json=body)
    with pytest.raises(ImdsRequestRejected) as info:
        client.get_document()
    assert info.value.status == status and "metadata header" in info.value.body


@pytest.mark.parametrize("status", [404, 410, 429, 500, 503])
def test_transient_statuses_are_unavailable(imds, client, status):
    """404, 410, 429 and 5xx are transient; the metric counts them by status."""
    _get(imds, status=status, json={"error": "x"})
    with pytest.raises(ImdsUnavailable) as info:
        client.get_document()
    assert info.value.code == str(status)
    assert client.metrics.imds_requests.labels("scheduledevents", str(status))._value.get() == 1


def test_429_retry_after_is_read(imds, client):
    """A Retry-After header on 429 is passed on so the next poll waits at least that long."""
    _get(imds, status=429, json={}, headers={"Retry-After": "7"})
    with pytest.raises(ImdsUnavailable) as info:
        client.get_document()
    assert info.value.retry_after == 7


def test_timeout_and_connection_errors_are_unavailable_with_code_error(imds, client):
    """A timeout is transient and counted as code="error"."""
    imds.get(SE, body=requests.exceptions.ConnectTimeout("slow"))
    with pytest.raises(ImdsUnavailable, match="timed out"):
        client.get_document()
    assert client.metrics.imds_requests.labels("scheduledevents", "error")._value.get() == 1


def test_html_answer_is_refused_as_a_proxy_page(imds, client):
    """A 200 with text/html (a proxy's page) is not read as a document."""
    imds.get(SE, body="<html>504 Gateway Timeout</html>", status=200, content_type="text/html")
    with pytest.raises(ImdsUnavailable, match="not JSON"):
        client.get_document()


def test_malformed_json_is_unavailable_and_counted(imds, client):
    """A truncated body fails the poll and counts a malformed document."""
    imds.get(SE, body='{"DocumentIncarnation": 1, "Ev', status=200, headers=JSON)
    with pytest.raises(ImdsUnavailable, match="malformed"):
        client.get_document()
    assert client.metrics.documents_malformed._value.get() == 1


def test_etag_is_sent_back_and_304_means_unchanged(imds, client):
    """When IMDS sends an ETag, the next poll sends If-None-Match and a 304 is 'unchanged'."""
    _get(imds, headers={"ETag": '"5"'})
    imds.get(SE, status=304, match=[matchers.header_matcher({"If-None-Match": '"5"'})])
    assert client.get_document().document is not None
    second = client.get_document()
    assert second.unchanged and second.document is None


def test_the_same_bytes_as_the_last_document_mean_unchanged(imds, client):
    """Without an ETag (real IMDS), a byte-identical answer is 'unchanged': nothing to parse or diff;
    any change in the body, even one event's status, gives the new document."""
    _get(imds)
    _get(imds)
    changed = {**DOC, "DocumentIncarnation": DOC["DocumentIncarnation"] + 1}
    _get(imds, json=changed)
    first, second, third = client.get_document(), client.get_document(), client.get_document()
    assert first.document is not None and not first.unchanged
    assert second.unchanged and second.document is None
    assert third.document is not None and third.document.incarnation == changed["DocumentIncarnation"]


def test_approve_posts_start_requests(imds, client):
    """Approval POSTs exactly {"StartRequests": [{"EventId": ...}]} with the Metadata header."""
    imds.post(SE, json={}, match=[matchers.json_params_matcher({"StartRequests": [{"EventId": "ABC"}]}),
                                  matchers.header_matcher({"Metadata": "true"})])
    client.approve(["ABC"])


def test_compute_identity(imds, client):
    """The VM's own name, computer name and scale set come from compute metadata."""
    imds.get(f"{BASE}/metadata/instance/compute", json={"name": "vmss_7", "vmId": "x", "vmScaleSetName": "vmss",
                                                       "osProfile": {"computerName": "vmss000007"}},
             match=[matchers.query_param_matcher({"api-version": "2021-02-01"})])
    assert client.compute_identity() == Identity("vmss_7", "vmss000007", "vmss")


def test_requests_to_real_imds_are_spaced_under_its_rate_limit(imds, client, clock):
    """Back-to-back calls to a non-loopback IMDS are spaced ≥ 0.25 s apart (4 req/s < 5 req/s limit)."""
    for _ in range(3):
        _get(imds)
    start = clock.monotonic()
    for _ in range(3):
        client.get_document()
    assert clock.monotonic() - start >= 0.5


def test_backoff_grows_caps_and_honours_retry_after():
    """Failed polls back off exponentially with jitter up to max_backoff; Retry-After wins; success resets."""
    mid = lambda: 0.5  # noqa: E731 - no jitter
    assert next_poll_delay(0, 1, 10, None, mid) == 1
    assert [next_poll_delay(n, 1, 10, None, mid) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert next_poll_delay(2, 1, 10, 30, mid) == 30
    lows = [next_poll_delay(3, 1, 10, None, lambda: 0.0), next_poll_delay(3, 1, 10, None, lambda: 0.999)]
    assert 3 <= lows[0] < 4 < lows[1] <= 5


def test_retry_after_accepts_seconds_and_http_dates():
    """Retry-After may be delta-seconds or an HTTP date."""
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert parse_retry_after("12", now) == 12
    assert parse_retry_after("Thu, 01 Jan 2026 00:00:30 GMT", now) == 30
    assert parse_retry_after("soon", now) is None and parse_retry_after(None, now) is None
