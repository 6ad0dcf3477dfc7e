"""The HTTP server with real sockets: routes, status codes, loopback/token rules, limits, slow clients."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import requests

from agent.http.auth import token_ok
from agent.http.http_connection import is_loopback
from agent.http.routes import ApiError, ApiServer
from agent.telemetry.metrics import Metrics

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class FakeBackend:
    """A backend that records mutations and serves canned views."""

    def __init__(self) -> None:
        self.in_rotation = True
        self.drained: list[str] = []
        self.reports: list[Any] = []
        self.peer_token: str | None = None
        self.by: list[str] = []

    def probe(self): return (self.in_rotation, "OK" if self.in_rotation else "draining (manual: test)")
    def app_health(self): return (True, "OK")
    def alive(self): return (True, "ticking")
    def metrics_text(self): return b"maintd_up 1\n"
    def status(self): return {"vm_name": "vm1"}
    def events(self): return [{"EventId": "E1"}]
    def health(self): return {"AggregatedHealthState": "Ok", "HealthEvents": [
        {"SourceId": "app", "Property": "db", "HealthState": "Ok", "Description": "db_password=hunter2",
         "IsExpired": False}]}

    def drain(self, reason, by):
        self.drained.append(reason)
        self.by.append(by)
        return {"drained": True}

    def undrain(self, by):
        self.by.append(by)
        return {"undrained": True}

    def event(self, event_id):
        if event_id != "E1":
            return None
        return {"EventId": event_id, "EventStatus": "Scheduled", "rank": 1, "ready": True,
                "results": [{"handler": "hook", "output": "db_password=hunter2"}], "Description": "operator notes"}

    def approve(self, event_id, by):
        if event_id != "E1":
            raise ApiError(404, "no such event")
        self.by.append(by)
        return {"approved": event_id}

    def report_health(self, body):
        if not isinstance(body, dict):
            raise ApiError(400, "SourceId is required")
        self.reports.append(body)
        return {"accepted": True}

    def peer_ready(self, event_id, body): return {"event_id": event_id, "asked_again": body == {"vm": "vm2"}}

    def peer_authorized(self, authorization): return self.peer_token is None or token_ok(authorization, self.peer_token)


@pytest.fixture
def server():
    backend = FakeBackend()
    srv = ApiServer("0.0.0.0:0", backend, Metrics(), token_reader=lambda: TOKEN, max_body_bytes=2048, read_timeout=0.5)
    srv.serve_in_background()
    port = srv.socket.getsockname()[1]
    yield srv, backend, port
    srv.close()


def session(source: str = "127.0.0.1") -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    adapter = requests.adapters.HTTPAdapter()
    adapter.init_poolmanager(10, 10, source_address=(source, 0))
    s.mount("http://", adapter)
    return s


def url(port: int, path: str, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{port}{path}"


def test_probe_answers_200_in_rotation_and_503_with_reason_when_out(server):
    """The LB probe: 200 OK in rotation, 503 with the reason when draining."""
    srv, backend, port = server
    r = session().get(url(port, "/probe"))
    assert (r.status_code, r.text.strip()) == (200, "OK")
    backend.in_rotation = False
    r = session().get(url(port, "/probe"))
    assert r.status_code == 503 and "draining" in r.text


@pytest.mark.parametrize("path,status", [("/healthz", 200), ("/metrics", 200), ("/v1/status", 200), ("/v1/events", 200),
                                         ("/v1/events/E1", 200), ("/v1/events/E2", 404), ("/v1/health", 200),
                                         ("/nope", 404)])
def test_read_endpoints(server, path, status):
    """Every GET endpoint answers, unknown paths and events are JSON 404s."""
    _, _, port = server
    r = session().get(url(port, path))
    assert r.status_code == status
    if status == 404:
        assert r.json()["status"] == 404 and r.json()["error"]


def test_wrong_method_is_405_with_allow(server):
    """POST on a GET endpoint (and GET on a POST one) is 405 with an Allow header."""
    _, _, port = server
    r = session().post(url(port, "/v1/status"))
    assert r.status_code == 405 and r.headers["Allow"] == "GET"
    r = session().get(url(port, "/v1/drain"))
    assert r.status_code == 405 and r.headers["Allow"] == "POST"


def test_mutations_from_loopback_need_the_token_by_default(server):
    """A local user (127.0.0.1) without the token gets 401 saying how to proceed; with the token the drain is
    done and journaled as the token's."""
    _, backend, port = server
    r = session().post(url(port, "/v1/drain"), json={"reason": "kernel patch"})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer" and backend.drained == []
    assert "server.token_file" in r.json()["error"] and "require_token_on_loopback: false" in r.json()["error"]
    r = session().post(url(port, "/v1/drain"), json={"reason": "kernel patch"}, headers=AUTH)
    assert r.status_code == 200 and backend.drained == ["kernel patch"] and backend.by == ["127.0.0.1 (token)"]


def test_loopback_may_act_without_the_token_only_when_opted_out():
    """server.require_token_on_loopback: false: 127.0.0.1 drains without a token; 127.0.0.2 still may not."""
    backend = FakeBackend()
    srv = ApiServer("0.0.0.0:0", backend, Metrics(), token_reader=lambda: TOKEN, require_token_on_loopback=False)
    srv.serve_in_background()
    try:
        port = srv.socket.getsockname()[1]
        assert session().post(url(port, "/v1/drain"), json={"reason": "local"}).status_code == 200
        assert session("127.0.0.2").post(url(port, "/v1/drain"), json={"reason": "x"}).status_code == 401
        assert backend.by == ["127.0.0.1"]
    finally:
        srv.close()


def test_mutations_from_another_address_need_the_token(server):
    """From 127.0.0.2 (playing a remote client): 401 without token, 403 with a wrong one, 200 with the right one."""
    _, backend, port = server
    remote = session("127.0.0.2")
    r = remote.post(url(port, "/v1/drain"), json={"reason": "x"})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    r = remote.post(url(port, "/v1/drain"), json={"reason": "x"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403
    r = remote.post(url(port, "/v1/drain"), json={"reason": "x"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and backend.drained == ["x"] and backend.by == ["127.0.0.2 (token)"]
    assert remote.get(url(port, "/probe")).status_code == 200


def test_peer_token_guards_reads_from_other_addresses(server):
    """With coordination.token_file set, /v1 reads from other hosts need that token; the probe never does."""
    _, backend, port = server
    backend.peer_token = "peer"
    remote = session("127.0.0.2")
    assert remote.get(url(port, "/v1/events/E1")).status_code == 401
    assert remote.get(url(port, "/v1/events/E1"), headers={"Authorization": "Bearer peer"}).status_code == 200
    assert remote.get(url(port, "/probe")).status_code == 200
    assert session().get(url(port, "/v1/events/E1")).status_code == 200


def test_oversized_body_is_413(server):
    """A body over server.max_body_bytes is refused with 413 before it is read."""
    _, backend, port = server
    r = session().post(url(port, "/v1/health/reports"), data=b"x" * 4096, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and backend.reports == []


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2"])
def test_malformed_json_is_400(server, body):
    """A body that is not JSON is 400 with a JSON error."""
    _, _, port = server
    r = session().post(url(port, "/v1/health/reports"), data=body, headers=AUTH)
    assert r.status_code == 400 and "JSON" in r.json()["error"]


def test_backend_validation_errors_pass_through_as_their_status(server):
    """An approval of an unknown event is the backend's 404; a bad report its 400."""
    _, _, port = server
    assert session().post(url(port, "/v1/events/NOPE/approve"), headers=AUTH).status_code == 404
    assert session().post(url(port, "/v1/health/reports"), json=[1], headers=AUTH).status_code == 400


def test_malformed_request_line_gets_a_json_400(server):
    """Garbage on the socket gets a JSON error, and the server keeps serving."""
    _, _, port = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"\x00\x01garbage\r\n\r\n")
        data = s.recv(4096)
    assert data.startswith(b"HTTP/1.1 400") or data.startswith(b"HTTP/1.0 400")
    assert session().get(url(port, "/healthz")).status_code == 200


def test_oversized_header_is_refused(server):
    """A header line over 64 KiB is refused and the server goes on."""
    _, _, port = server
    r = session().get(url(port, "/healthz"), headers={"X-Big": "a" * 70000})
    assert r.status_code == 431 or r.status_code == 400
    assert session().get(url(port, "/healthz")).status_code == 200


def test_slow_client_is_disconnected_and_others_are_served(server):
    """A client that sends half a request is dropped after server.read_timeout; others are served meanwhile."""
    _, _, port = server
    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"GET /probe HTTP/1.1\r\nHost: x\r\n")
    assert session().get(url(port, "/probe")).status_code == 200
    slow.settimeout(3)
    start = time.monotonic()
    data = slow.recv(4096)
    assert time.monotonic() - start < 2.5
    assert data == b"" or b"408" in data or b"400" in data
    slow.close()


def test_requests_are_counted_by_route_and_code(server):
    """maintd_http_requests_total counts by bounded route name, never by raw path."""
    srv, _, port = server
    session().get(url(port, "/probe"))
    session().get(url(port, "/v1/events/E2"))
    text = srv.metrics.render().decode()
    assert 'maintd_http_requests_total{code="200",route="probe"} 1.0' in text
    assert 'maintd_http_requests_total{code="404",route="event"} 1.0' in text
    assert "E2" not in text


def test_is_loopback_and_token_rules():
    """Only 127.0.0.1 and ::1 count as this host; the token is a Bearer compared exactly."""
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("127.0.0.2") and not is_loopback("10.0.0.1") and not is_loopback("garbage")
    assert token_ok("Bearer abc", "abc") and token_ok("bearer abc", "abc")
    assert not token_ok("Bearer abcd", "abc") and not token_ok("Basic abc", "abc") and not token_ok(None, "abc")
    assert not token_ok("Bearer ", None)


def test_peer_ready_hint_needs_only_the_peer_token(server):
    """POST /v1/events/{id}/peer-ready: a hint between peers, guarded like the /v1 reads (202 Accepted)."""
    srv, backend, port = server
    backend.peer_token = "peer-token"
    remote = session("127.0.0.2")
    assert remote.post(url(port, "/v1/events/E1/peer-ready"), json={"vm": "vm2"}).status_code == 401
    r = remote.post(url(port, "/v1/events/E1/peer-ready"), json={"vm": "vm2"},
                    headers={"Authorization": "Bearer peer-token"})
    assert (r.status_code, r.json()["asked_again"]) == (202, True)
