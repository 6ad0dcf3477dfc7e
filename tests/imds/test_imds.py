"""The IMDS client against a scripted IMDS on 127.0.0.1: headers, proxies, status handling, ETag,
keep-alive and reconnects, deadlines, and answers built to hurt (trickles, floods, deep nesting)."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.errors import ImdsError, ImdsRequestRejected, ImdsUnavailable
from agent.imds.imds_client import MAX_DOCUMENT_BYTES, MAX_RETRY_AFTER, ImdsClient, PollResult
from agent.loop.cadence import next_poll_delay
from agent.model.identity import Identity
from agent.net.httpdates import retry_after
from agent.telemetry.metrics import Metrics
from tests.imds_server import FakeImds, Raw
from tests.samples import sample

SE = "/metadata/scheduledevents"
DOC = {"DocumentIncarnation": 1, "Events": []}


@pytest.fixture
def imds():
    server = FakeImds()
    yield server
    server.close()


def make_client(imds, clock, timeout=10.0, first_timeout=120.0):
    return ImdsClient(imds.url, "2020-07-01", timeout=timeout, first_timeout=first_timeout,
                      compute_api_version="2021-02-01", clock=clock, metrics=Metrics())


@pytest.fixture
def client(imds, clock):
    return make_client(imds, clock)


def count(client, code, endpoint="scheduledevents"):
    return sample(client.metrics, "maintd_imds_requests_total", endpoint=endpoint, code=code)


def test_poll_sends_metadata_header_and_api_version(imds, client):
    """Every poll carries `Metadata: true` and api-version=2020-07-01, and nothing is retried."""
    imds.get(SE, json=DOC)
    result = client.get_document()
    assert result.document is not None and result.document.incarnation == 1
    [call] = imds.calls
    assert call.headers["metadata"] == "true" and call.query == {"api-version": "2020-07-01"}


def test_proxy_variables_are_ignored(imds, client, monkeypatch):
    """HTTP_PROXY and friends in the environment never route an IMDS call through a proxy."""
    proxy = FakeImds()
    try:
        for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(var, proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        imds.get(SE, json=DOC)
        imds.post(SE, json={})
        imds.get("/metadata/instance/compute", json={"name": "vm1"})
        client.get_document()
        client.approve(["E1"])
        assert client.compute_identity().name == "vm1"
        assert len(imds.calls) == 3 and proxy.calls == [] and proxy.connections == 0
    finally:
        proxy.close()


def test_first_call_uses_the_long_timeout_then_the_short_one(imds, clock):
    """IMDS may take long to answer the first request; later polls use imds.timeout."""
    def slow(call):
        time.sleep(0.4)
        return 200, {"Content-Type": "application/json"}, json.dumps(DOC)

    imds.add_callback("GET", SE, slow)
    client = make_client(imds, clock, timeout=0.1, first_timeout=3)
    assert client.get_document().document is not None
    with pytest.raises(ImdsUnavailable, match="timed out"):
        client.get_document()


@pytest.mark.parametrize("status", [400, 405])
def test_400_and_405_mean_the_request_is_wrong(imds, client, status):
    """400/405 are ImdsRequestRejected, with IMDS's body kept for the log."""
    imds.get(SE, status=status, json={"error": "Bad request. Required metadata header not specified"})
    with pytest.raises(ImdsRequestRejected) as info:
        client.get_document()
    assert info.value.status == status and "metadata header" in info.value.body


@pytest.mark.parametrize("status", [404, 410, 429, 500, 503])
def test_transient_statuses_are_unavailable(imds, client, status):
    """404, 410, 429 and 5xx are transient; the metric counts them by status."""
    imds.get(SE, status=status, json={"error": "x"})
    with pytest.raises(ImdsUnavailable) as info:
        client.get_document()
    assert info.value.code == str(status)
    assert count(client, str(status)) == 1


def test_429_retry_after_is_read(imds, client):
    """A Retry-After header on 429 is passed on so the next poll waits at least that long."""
    imds.get(SE, status=429, json={}, headers={"Retry-After": "7"})
    with pytest.raises(ImdsUnavailable) as info:
        client.get_document()
    assert info.value.retry_after == 7


def test_a_connection_closed_without_answer_is_unavailable_with_code_error(imds, client):
    """A connection IMDS drops is transient and counted as code="error"."""
    imds.get(SE, body=ConnectionResetError("gone"))
    with pytest.raises(ImdsUnavailable, match="connection failed"):
        client.get_document()
    assert count(client, "error") == 1


def test_nobody_listening_is_unavailable(clock):
    """Connection refused is transient too."""
    gone = FakeImds()
    gone.close()
    client = make_client(gone, clock)
    with pytest.raises(ImdsUnavailable, match="connection failed"):
        client.get_document()


def test_html_answer_is_refused_as_a_proxy_page(imds, client):
    """A 200 with text/html (a proxy's page) is not read as a document."""
    imds.get(SE, body="<html>504 Gateway Timeout</html>", content_type="text/html")
    with pytest.raises(ImdsUnavailable, match="not JSON"):
        client.get_document()


def test_malformed_json_is_unavailable_and_counted(imds, client):
    """A truncated body fails the poll and counts a malformed document."""
    imds.get(SE, body='{"DocumentIncarnation": 1, "Ev')
    with pytest.raises(ImdsUnavailable, match="malformed"):
        client.get_document()
    assert sample(client.metrics, "maintd_documents_malformed_total") == 1


def test_etag_is_sent_back_and_304_means_unchanged(imds, client):
    """When IMDS sends an ETag, the next poll sends If-None-Match and a 304 is 'unchanged'."""
    imds.get(SE, json=DOC, headers={"ETag": '"5"'})
    imds.get(SE, status=304)
    assert client.get_document().document is not None
    second = client.get_document()
    assert second.unchanged and second.document is None
    assert "if-none-match" not in imds.calls[0].headers and imds.calls[1].headers["if-none-match"] == '"5"'


def test_an_etag_that_would_split_the_request_is_not_sent_back(imds, client):
    """An ETag that is too long or not printable is ignored (never echoed into a request)."""
    imds.get(SE, json=DOC, headers={"ETag": "x" * 5000})
    client.get_document()
    client.get_document()
    assert "if-none-match" not in imds.calls[1].headers


def test_the_same_bytes_as_the_last_document_mean_unchanged(imds, client):
    """Without an ETag (real IMDS), a byte-identical answer is 'unchanged': nothing to parse or diff;
    any change in the body, even one event's status, gives the new document."""
    changed = {**DOC, "DocumentIncarnation": DOC["DocumentIncarnation"] + 1}
    imds.get(SE, json=DOC)
    imds.get(SE, json=DOC)
    imds.get(SE, json=changed)
    first, second, third = client.get_document(), client.get_document(), client.get_document()
    assert first.document is not None and not first.unchanged
    assert second.unchanged and second.document is None
    assert third.document is not None and third.document.incarnation == changed["DocumentIncarnation"]


def test_polls_reuse_one_connection(imds, client):
    """Polls go over one keep-alive connection."""
    imds.get(SE, json=DOC)
    for _ in range(5):
        client.get_document()
    assert {c.connection for c in imds.calls} == {1} and imds.connections == 1


def test_a_connection_the_server_closed_while_idle_is_opened_again_without_a_failed_poll(imds, client):
    """IMDS (or a NAT) closing the idle keep-alive connection costs nothing: the next poll reconnects."""
    body = json.dumps(DOC).encode()
    closing = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    imds.add_callback("GET", SE, lambda call: Raw(closing, then="close"))
    imds.add_callback("GET", SE, lambda call: Raw(closing, then="reset"))
    imds.get(SE, json=DOC)
    for _ in range(3):
        time.sleep(0.05)  # let the close arrive before the next poll
        client.get_document()
    assert imds.connections == 3 and count(client, "error") == 0


def test_a_reset_fails_one_poll_and_the_next_reconnects(imds, client):
    """A connection reset mid-answer fails that poll only; the next one opens a new connection."""
    imds.get(SE, json=DOC)
    imds.add_callback("GET", SE, lambda call: Raw(b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{", then="reset"))
    imds.get(SE, json={**DOC, "DocumentIncarnation": 2})
    client.get_document()
    with pytest.raises(ImdsUnavailable, match="connection failed"):
        client.get_document()
    assert client.get_document().document.incarnation == 2
    assert imds.connections == 2


def test_approve_posts_start_requests(imds, client):
    """Approval POSTs exactly {"StartRequests": [{"EventId": ...}]} with the Metadata header."""
    imds.post(SE, json={})
    client.approve(["ABC"])
    [call] = imds.calls
    assert json.loads(call.body) == {"StartRequests": [{"EventId": "ABC"}]}
    assert call.headers["metadata"] == "true" and call.query == {"api-version": "2020-07-01"}


def test_compute_identity(imds, client):
    """The VM's own name, computer name and scale set come from compute metadata."""
    imds.get("/metadata/instance/compute", json={"name": "vmss_7", "vmId": "x", "vmScaleSetName": "vmss",
                                                 "osProfile": {"computerName": "vmss000007"}})
    assert client.compute_identity() == Identity("vmss_7", "vmss000007", "vmss")
    assert imds.calls[0].query == {"api-version": "2021-02-01"}


@pytest.mark.parametrize("body", [
    "[" * 100_000 + "]" * 100_000,
    '{"name": ' + "[" * 5000 + "]" * 5000 + "}",
    '["vm1"]',
    '{"name": "' + "v" * 1000 + '"}',
    '{"name": "vm\\u0000"}',
    "\xff\xfe",
])
def test_compute_answers_that_cannot_be_used_fail_the_request_and_nothing_else(imds, client, body):
    """Any compute answer without a usable name (deep nesting, wrong shape, absurd name) is an ImdsError."""
    imds.get("/metadata/instance/compute", body=body.encode("latin-1"))
    with pytest.raises(ImdsUnavailable):
        client.compute_identity()


def test_requests_to_real_imds_are_spaced_under_its_rate_limit(imds, clock, monkeypatch):
    """Back-to-back calls to a non-loopback IMDS are spaced ≥ 0.25 s apart (4 req/s < 5 req/s limit)."""
    monkeypatch.setattr("agent.imds.imds_client.is_loopback_url", lambda endpoint: False)
    client = make_client(imds, clock)
    imds.get(SE, json=DOC)
    start = clock.monotonic()
    for _ in range(3):
        client.get_document()
    assert clock.monotonic() - start >= 0.5


# --- hostile answers ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickling_imds_cannot_hold_a_poll_past_its_timeout(imds, clock, where):
    """One byte every 50 ms (a 150-byte answer takes 7 s): the poll fails at its 0.5 s deadline, counted."""
    body = json.dumps(DOC).encode() + b" " * 60
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    fast = len(head) if where == "body" else 0
    imds.add_callback("GET", SE, lambda call: Raw(head + body, trickle=0.05, fast=fast))
    client = make_client(imds, clock, timeout=0.5, first_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(ImdsUnavailable, match="timed out"):
        client.get_document()
    assert time.monotonic() - started < 3, "failed at its deadline, not when the answer ended"
    assert count(client, "error") == 1


def test_a_poll_can_be_cut_short_from_another_thread(imds, clock):
    """A stop need not wait for the poll's timeout: interrupt() makes the poll under way fail at once,
    including on a kept connection (it is not silently retried)."""
    imds.get(SE, json=DOC)
    imds.add_callback("GET", SE, lambda call: Raw(b"HTTP/1.1 200 OK\r\n", trickle=30))
    client = make_client(imds, clock, timeout=20, first_timeout=20)
    client.get_document()
    timer = threading.Timer(0.2, client.interrupt)
    timer.start()
    started = time.monotonic()
    with pytest.raises(ImdsUnavailable):
        client.get_document()
    assert time.monotonic() - started < 5
    timer.join()


def test_deep_nesting_fails_the_poll_and_the_next_good_answer_is_read(imds, client):
    """{"Events": [[[[...]]]]} 100 000 deep is a malformed document, never a RecursionError."""
    imds.get(SE, body='{"Events": ' + "[" * 100_000 + "]" * 100_000 + "}")
    imds.get(SE, json={**DOC, "DocumentIncarnation": 3})
    with pytest.raises(ImdsUnavailable, match="malformed"):
        client.get_document()
    assert sample(client.metrics, "maintd_documents_malformed_total") == 1
    assert client.get_document().document.incarnation == 3


@pytest.mark.parametrize("framing", ["content-length", "until-close", "chunked"])
def test_a_body_over_the_size_cap_is_refused_before_it_is_read_whole(imds, client, framing):
    """An answer larger than MAX_DOCUMENT_BYTES fails the poll, however it is framed."""
    size = MAX_DOCUMENT_BYTES + 1
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    if framing == "content-length":
        raw = head + b"Content-Length: %d\r\n\r\n" % size + b" " * size
    elif framing == "until-close":
        raw = head + b"Connection: close\r\n\r\n" + b" " * size
    else:
        chunk = b" " * 65536
        raw = head + b"Transfer-Encoding: chunked\r\n\r\n" + (b"10000\r\n" + chunk + b"\r\n") * (size // 65536 + 1)
    imds.add_callback("GET", SE, lambda call: Raw(raw))
    with pytest.raises(ImdsUnavailable, match="too large"):
        client.get_document()


GARBAGE = {
    "not http": b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
    "status line of 60 KB": b"HTTP/1.1 " + b"9" * 60_000 + b" OK\r\n\r\n",
    "binary": bytes(range(256)) * 4,
    "header line of 100 KB": b"HTTP/1.1 200 OK\r\nX: " + b"a" * 100_000 + b"\r\n\r\n",
    "200 headers": b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200 + b"\r\n",
    "bad chunk size": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "short body": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{}",
    "negative length": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: -5\r\n\r\n{}",
    "status 999": b"HTTP/1.1 999 Odd\r\nContent-Length: 0\r\n\r\n",
    "endless 100 Continue": b"HTTP/1.1 100 Continue\r\n\r\n" * 5000,
}


@pytest.mark.parametrize("raw", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_on_the_wire_is_a_failed_poll(imds, client, raw):
    """Whatever bytes come back, the poll raises ImdsUnavailable (nothing else, and a message short enough
    for one log line) and the next one works."""
    imds.add_callback("GET", SE, lambda call: Raw(raw))
    imds.get(SE, json=DOC)
    with pytest.raises(ImdsUnavailable) as info:
        client.get_document()
    assert len(str(info.value)) + len(info.value.body) < 2000
    assert client.get_document().document is not None


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                       lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
                           st.sampled_from(["Events", "EventId", "EventType", "EventStatus", "Resources",
                                            "NotBefore", "Description", "DocumentIncarnation", "x"]),
                           inner, max_size=6), max_leaves=30)
HEADS = [b"", b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n",
         b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n",
         b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
         b"HTTP/1.1 304 Not Modified\r\n\r\n", b"HTTP/1.1 429 X\r\nRetry-After: "]


def _with_length(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


ANSWERS = (st.tuples(st.sampled_from(HEADS), st.binary(max_size=1024)).map(b"".join)
           | JSONISH.map(lambda v: _with_length(json.dumps(v).encode()))
           | JSONISH.map(lambda v: _with_length(json.dumps({"Events": [v]}).encode())))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=ANSWERS)
def test_any_answer_is_a_poll_result_or_imds_unavailable(imds, client, raw):
    """Fuzz: whatever IMDS sends (random bytes, HTTP framing with random bodies, random JSON), the poll
    returns a result or raises ImdsUnavailable, and never anything else."""
    imds.clear()
    imds.add_callback("GET", SE, lambda call: Raw(raw))
    try:
        assert isinstance(client.get_document(), PollResult)
    except ImdsUnavailable:
        pass


def test_backoff_grows_caps_and_honours_retry_after():
    """Failed polls back off exponentially with jitter up to max_backoff; Retry-After wins; success resets."""
    mid = lambda: 0.5  # noqa: E731 - no jitter
    assert next_poll_delay(0, 1, 10, None, mid) == 1
    assert [next_poll_delay(n, 1, 10, None, mid) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert next_poll_delay(2, 1, 10, 30, mid) == 30
    lows = [next_poll_delay(3, 1, 10, None, lambda: 0.0), next_poll_delay(3, 1, 10, None, lambda: 0.999)]
    assert 3 <= lows[0] < 4 < lows[1] <= 5


def parse_retry_after(value, now):
    return retry_after(value, now, MAX_RETRY_AFTER)


def test_retry_after_accepts_seconds_and_http_dates():
    """Retry-After may be delta-seconds or an HTTP date."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_retry_after("12", now) == 12
    assert parse_retry_after("Thu, 01 Jan 2026 00:00:30 GMT", now) == 30
    assert parse_retry_after("soon", now) is None and parse_retry_after(None, now) is None


def test_an_absurd_retry_after_cannot_stop_polling():
    """A Retry-After of a day, of 5000 digits or a date in 2099 waits MAX_RETRY_AFTER at most."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    for value in ("86400", "9" * 5000, "Thu, 01 Jan 2099 00:00:00 GMT"):
        assert parse_retry_after(value, now) == MAX_RETRY_AFTER


COMPUTE = "/metadata/instance/compute"
CALLS = {"poll": (("GET", SE), lambda c: c.get_document()),
         "compute": (("GET", COMPUTE), lambda c: c.compute_identity()),
         "approve": (("POST", SE), lambda c: c.approve(["E1"]))}


@pytest.mark.parametrize("value", [b"\xb2", b"\xb9\xb3", b"1\xb2", b" \xb2 "])
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_retry_after_of_unicode_digits_fails_the_request_and_nothing_else(imds, client, call, value, logs):
    """`Retry-After: ²` (Latin-1 0xB2 passes str.isdigit) fails the poll, the compute call and the approval
    as an ImdsUnavailable without a Retry-After (and a log line), never a ValueError that ends `maintd run`."""
    (method, path), do = call
    imds.add_callback(method, path, lambda _: Raw(b"HTTP/1.1 503 Busy\r\nRetry-After: " + value
                                                  + b"\r\nContent-Length: 0\r\n\r\n", then="keep"))
    with pytest.raises(ImdsUnavailable) as info:
        do(client)
    assert info.value.status == 503 and info.value.retry_after is None
    assert [e["value"] for e in logs if e["event"] == "imds.retry_after_ignored"] == [value.decode("latin-1").strip()]


def test_retry_after_is_read_strictly():
    """Only ASCII digits or an HTTP-date count; Unicode digits, signs, fractions and dates that are no
    dates are ignored."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_retry_after(" 12 ", now) == 12
    for value in ("²", "١٢", "+5", "-5", "1.5", "1e3", "0x10", "Thu, 01 Jan 2026 99:00:30 GMT", "tomorrow"):
        assert parse_retry_after(value, now) is None, value


STATUS_LINES = st.sampled_from([b"HTTP/1.1 %d X" % s for s in (103, 200, 304, 400, 404, 410, 429, 500, 503, 999)]
                               + [b"HTTP/1.1 \xb2\xb2\xb2 X", b"HTTP/1.1 \xd9\xa3 X", b"HTTP/1.1 2OO OK",
                                  b"HTTP/9 200 OK", b"HTTP/1.1 -200 X", b"HTTP/1.1 200"]) | st.binary(max_size=40)
NAMES = st.sampled_from([b"Retry-After", b"retry-after", b"ETag", b"Content-Type", b"Content-Length",
                        b"Transfer-Encoding", b"Connection"])
VALUES = st.sampled_from([b"\xb2", b"\xb9\xb3", b"\xd9\xa3", b"1" * 400, b"Thu, 01 Jan 2026 00:00:30 GMT",
                          b"Mon, 01 Jan 0001 00:00:00 -2359", b"application/json", b"chunked", b"close", b"-1", b"0",
                          b"\xff\xfe"])
HEADER_NAMES = st.one_of(NAMES, NAMES, NAMES, st.binary(min_size=1, max_size=20))
HEADER_VALUES = st.one_of(VALUES, VALUES, VALUES, st.binary(max_size=60))
RAW_ANSWERS = st.builds(lambda status, headers, body: status + b"\r\n"
                        + b"".join(n + b": " + v + b"\r\n" for n, v in headers) + b"\r\n" + body,
                        STATUS_LINES, st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=6),
                        st.sampled_from([b"", json.dumps(DOC).encode(), b'{"name": "vm1"}', b"{}"])
                        | st.binary(max_size=80))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=RAW_ANSWERS, which=st.sampled_from(sorted(CALLS)))
def test_any_status_line_or_header_is_a_result_or_an_imds_error(imds, clock, raw, which):
    """Fuzz over status lines, header names and values and bodies: the poll, the compute call and the
    approval return or raise an ImdsError, never anything else."""
    imds.clear()
    (method, path), do = CALLS[which]
    imds.add_callback(method, path, lambda _: Raw(raw))
    try:
        do(make_client(imds, clock, timeout=0.5))
    except ImdsError:
        pass


@pytest.mark.parametrize("interim", [b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n",
                                     b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\n\r\n",
                                     b"HTTP/1.1 100 Continue\r\n\r\n"])
def test_interim_1xx_answers_are_skipped_within_the_polls_deadline(imds, client, interim):
    """An IMDS (or a box in front of it) that sends 103 Early Hints or any other 1xx before its answer
    does not fail the poll: the interim answers are skipped and the final one read."""
    body = json.dumps(DOC).encode()
    imds.add_callback("GET", SE, lambda _: Raw(interim + _with_length(body), then="keep"))
    assert client.get_document().document.incarnation == 1
    assert count(client, "200") == 1
