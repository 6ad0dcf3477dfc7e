"""The budget's wake hint over real sockets: a release's hint reaches the member handed a place through
POST /v1/budget/wake, guarded like the peers' reads (coordination.token_file); bad input is a 400, never a
crash; a hint nobody takes is only counted; a hint goes only where this VM's config derives for the member's name,
never to the `url` the record gives; and what a member writes as its own `url` (`advertise`, shown only)."""

from __future__ import annotations

import http.server
import threading
from datetime import timedelta
from typing import Any

import pytest

from agent.clock import FakeClock
from agent.fleet import budget_wake
from agent.fleet.budget import Budget
from agent.fleet.budget_rules import CHOSEN, Entry
from agent.fleet.budget_wake import WakeSender, advertised
from agent.http.routes import ApiError, ApiServer
from agent.telemetry.metrics import Metrics
from tests.budget_fakes import CasStore, member, want
from tests.fleet.test_budget import settle
from tests.http.test_server import FakeBackend, session, url


class WakeBackend(FakeBackend):
    """The test server's backend with a real budget behind /v1/budget/wake (as `LocalApi.budget_wake`)."""

    budget: Budget

    def budget_wake(self, body: Any) -> dict[str, Any]:
        try:
            return self.budget.wake(body)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None


@pytest.fixture
def waiting():  # type: ignore[no-untyped-def]
    """`b` waits for the place `a` holds (a 10-minute fallback poll) and takes hints at a real server on
    127.0.0.1; `a` sends its hints with the real sender."""
    backend = WakeBackend()
    backend.peer_token = "peer-token"
    srv = ApiServer("0.0.0.0:0", backend, Metrics(), token_reader=lambda: "operator", max_body_bytes=2048)
    srv.serve_in_background()
    port = srv.socket.getsockname()[1]
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=1)
    metrics = Metrics()
    a, _ = member(store, clock, "a", hints=WakeSender(lambda: "peer-token", metrics,
                                                    lambda name: url(port, "") if name == "b" else None),
                  fallback_poll=600)
    b, _ = member(store, clock, "b", url=url(port, ""), fallback_poll=600)
    backend.budget = b
    wants = {"a": [want("ea", nb)], "b": [want("eb", nb)]}
    settle([a], wants, {})
    assert not settle([b], wants, {})["b"].allowed
    yield metrics, a, b, wants, port
    srv.close()
    a.stop()
    b.stop()


def test_a_release_hands_the_place_over_and_its_hint_makes_the_member_leave_at_once(waiting) -> None:  # type: ignore[no-untyped-def]
    """Over real sockets: `a` back in rotation; `b`, handed the place in a's write and hinted through POST
    /v1/budget/wake, takes it with no time passing (its own poll is 10 minutes away)."""
    metrics, a, b, wants, _ = waiting
    wants.pop("a")
    settle([a], wants, {})
    assert [(h["vm"], h["why"]) for h in a.publish()["holders"]] == [("b", CHOSEN)]
    assert 'maintd_budget_wake_hints_total{outcome="sent"} 1.0' in metrics.render().decode()
    assert settle([b], wants, {})["b"].allowed == {"eb"}


def test_the_wake_endpoint_needs_the_peer_token_and_bad_input_is_a_400(waiting) -> None:  # type: ignore[no-untyped-def]
    *_, port = waiting
    remote = session("127.0.0.2")
    wake = url(port, "/v1/budget/wake")
    assert remote.post(wake, json={"vm": "b"}).status_code == 401
    good = {"Authorization": "Bearer peer-token"}
    r = remote.post(wake, json={"group": "web", "vm": "b"}, headers=good)
    assert (r.status_code, r.json()) == (202, {"woken": True})
    for body in (b"[1]", b'"x"', b'{"vm": 5}', b"{", b"\xff" * 40):
        r = remote.post(wake, data=body, headers={**good, "Content-Type": "application/json"})
        assert r.status_code == 400, body
    assert remote.post(wake, json={"vm": "b"}, headers=good).status_code == 202  # still serving
    assert remote.get(wake, headers=good).status_code == 405


def test_a_hint_nobody_takes_is_counted_and_never_stops_the_sender() -> None:
    metrics = Metrics()
    sender = WakeSender(lambda: None, metrics, {"gone": "http://127.0.0.1:9"}.get, timeout=0.5)
    now = FakeClock().now()
    sender.send("web", [Entry("gone", "1", "0", "e", CHOSEN, now, now),
                        Entry("nourl", "1", "0", "e", CHOSEN, now, now, "http://127.0.0.1:9")])
    assert sender.wait_idle(15)  # three tries: nobody listens, a transient failure
    assert 'maintd_budget_wake_hints_total{outcome="failed"} 1.0' in metrics.render().decode()
    sender.stop()


class Flaky(http.server.BaseHTTPRequestHandler):
    """A member's server that answers the first hints with `answers`, then 202."""

    answers: list[int] = []
    asked = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status = Flaky.answers[Flaky.asked] if Flaky.asked < len(Flaky.answers) else 202
        Flaky.asked += 1
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("answers, asked, outcome", [
    ([503, 503], 3, "sent"),  # a member restarting: the third try reaches it
    ([503, 503, 503], 3, "failed"),  # still down: the member finds its place on its fallback poll
    ([401], 1, "failed"),  # a refusal is not asked again
])
def test_a_hint_that_meets_a_transient_failure_is_sent_again(monkeypatch: pytest.MonkeyPatch, answers: list[int],
                                                              asked: int, outcome: str) -> None:
    monkeypatch.setattr(budget_wake, "RETRY_AFTER", (0.05, 0.05))
    Flaky.answers, Flaky.asked = answers, 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    metrics = Metrics()
    sender = WakeSender(lambda: None, metrics, lambda name: f"http://127.0.0.1:{server.server_port}")
    now = FakeClock().now()
    try:
        sender.send("web", [Entry("b", "1", "0", "e", CHOSEN, now, now)])
        assert sender.wait_idle(15)
        assert Flaky.asked == asked
        assert f'maintd_budget_wake_hints_total{{outcome="{outcome}"}} 1.0' in metrics.render().decode()
    finally:
        sender.stop()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("advertise, listen, ip, expected", [
    ("auto", "0.0.0.0:8088", "10.0.0.5", "http://10.0.0.5:8088"),
    ("auto", "10.0.0.7:9000", None, "http://10.0.0.7:9000"),
    ("auto", "127.0.0.1:8088", "10.0.0.5", ""),
    ("auto", "0.0.0.0:8088", None, ""),
    ("none", "0.0.0.0:8088", "10.0.0.5", ""),
    ("http://vm-3.internal:8088/", "127.0.0.1:8088", None, "http://vm-3.internal:8088"),
])
def test_where_a_member_takes_hints(advertise: str, listen: str, ip: str | None, expected: str) -> None:
    assert advertised(advertise, listen, lambda: ip) == expected


class Recorder(http.server.BaseHTTPRequestHandler):
    """A listener that records who POSTed what with which Authorization, and answers 202."""

    seen: list[tuple[int, str, str]]

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append((self.server.server_port, self.path, self.headers.get("Authorization", "")))  # type: ignore[attr-defined]
        self.send_response(202)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_url_forged_into_the_record_never_receives_the_token() -> None:
    """A waiter's entry says its `url` is a listener of the forger's: the release's hint, with the coordination
    token, goes only to the address wake_url derives for the waiter's name; the forged listener receives nothing.
    A name that is not a host name gets no hint at all. (The waiter is named by an address literal: a name to
    resolve would depend on the host's /etc/hosts, which a bare Debian root lacks.)"""
    from agent.coordination.member_urls import member_url

    seen: list[tuple[int, str, str]] = []
    servers = []
    for _ in range(2):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
        server.seen = seen  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    forged, honest = (s.server_port for s in servers)
    clock = FakeClock()
    store = CasStore(clock)
    nb = clock.now() + timedelta(hours=1)
    template = f"http://{{name}}:{honest}"
    sender = WakeSender(lambda: "peer-token", Metrics(), lambda name: member_url(template, name, None))
    a, _ = member(store, clock, "a", hints=sender)
    b, _ = member(store, clock, "127.0.0.1", url=f"http://127.0.0.1:{forged}")
    wants = {"a": [want("ea", nb)], "127.0.0.1": [want("eb", nb)]}
    try:
        settle([a], wants, {})
        assert not settle([b], wants, {})["127.0.0.1"].allowed
        assert f"http://127.0.0.1:{forged}" in store.blobs["budget/web/places"][0].decode()  # forged into the record
        wants.pop("a")
        settle([a], wants, {})  # back in rotation: the release seats "127.0.0.1" and hints it
        assert sender.wait_idle(15)
        assert seen == [(honest, "/v1/budget/wake", "Bearer peer-token")]
        now = clock.now()
        sender.send("web", [Entry(f"127.0.0.1:{forged}", "1", "0", "e", CHOSEN, now, now,
                                  f"http://127.0.0.1:{forged}")])  # a name that is no host name: no hint at all
        assert sender.wait_idle(15)
        assert [p for p, *_ in seen if p == forged] == [] and len(seen) == 1
    finally:
        sender.stop()
        for server in servers:
            server.shutdown()
            server.server_close()
