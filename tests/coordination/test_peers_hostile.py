"""Issue 24: a hostile or broken peer, gate or webhook endpoint on a real loopback socket costs the
leader at most the request timeout and a byte cap, and only silence counts towards a takeover."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import responses

from agent.clock import FakeClock
from agent.config.config import loads
from agent.coordination.approval_gates import GateChecker
from agent.coordination.peers.peer_client import INVALID, NOT_READY, READY, UNREACHABLE, PeerClient, readiness
from agent.errors import AnswerTooLarge, ExchangeTimeout
from agent.handlers.base import FAILED
from agent.handlers.registry import instantiate
from agent.model.gate_specs import Gates, PrometheusGate
from agent.state.state_store import Store
from agent.telemetry.metrics import Metrics
from tests.coordination.test_coordinator import make_coordinator, peer, step, tracked, view
from tests.handlers.test_handler_webhook import context

TIMEOUT = 1.0
SLACK = 1.0
"""Seconds past the request timeout an exchange may take (thread scheduling on a loaded 2-core box)."""
GIVE_UP = 8.0
"""How long a hostile server keeps at it: today's client would otherwise be held for ever."""


class Hostile:
    """A loopback HTTP server that reads a request head, then misbehaves as `behaviour` says; counts what it sent."""

    def __init__(self, behaviour: Callable[[socket.socket, Hostile], None]) -> None:
        self.behaviour = behaviour
        self.sent = 0
        self.stop = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            try:
                self.behaviour(conn, self)
            except OSError:
                pass  # the client hung up: what the test wants

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.stop.set()
        self.server.close()


def endless(conn: socket.socket, server: Hostile) -> None:
    """200 with no length, then bytes as fast as the client takes them (64 MiB at most)."""
    server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{\"ready\": ")
    block = b" " * 65536
    while not server.stop.is_set() and server.sent < 64 * 2**20:
        server.send(conn, block)


def trickle(head: bytes, body: bytes) -> Callable[[socket.socket, Hostile], None]:
    """`head` at once, then `body` a byte every 50 ms (for GIVE_UP seconds at most)."""

    def behave(conn: socket.socket, server: Hostile) -> None:
        server.send(conn, head)
        until = time.monotonic() + GIVE_UP
        for byte in body:
            if server.stop.is_set() or time.monotonic() > until:
                return
            server.send(conn, bytes([byte]))
            time.sleep(0.05)

    return behave


TRICKLE_BODY = trickle(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4000\r\n\r\n",
                       b'{"ready": true' + b" " * 3985 + b"}")
TRICKLE_HEAD = trickle(b"", b"HTTP/1.1 200 OK\r\n" + b"X-Slow: yes\r\n" * 300 + b"Content-Length: 2\r\n\r\n{}")


@pytest.fixture
def hostile() -> Iterator[Callable[[Callable[[socket.socket, Hostile], None]], Hostile]]:
    made: list[Hostile] = []

    def make(behaviour: Callable[[socket.socket, Hostile], None]) -> Hostile:
        made.append(Hostile(behaviour))
        return made[-1]

    yield make
    for server in made:
        server.close()


def timed(call: Callable[[], object]) -> tuple[object, float]:
    """`call()`'s result (or exception) and how long it took; fails if it is still running after GIVE_UP + 2 s."""
    out: list[object] = []
    start = time.monotonic()

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GIVE_UP + 2)
    assert out, "the exchange was still under way long after its timeout"
    return out[0], time.monotonic() - start


def client() -> PeerClient:
    return PeerClient(lambda: "t0ken", TIMEOUT, 2)


# --- finding 1: bounded in bytes and in time ---------------------------------------------------

def test_an_endless_peer_answer_is_cut_at_the_byte_cap_within_the_timeout(hostile):
    """An answer that never ends is read to 256 KiB and no further: alive-but-garbled, not memory growth."""
    server = hostile(endless)
    answer, took = timed(lambda: client().ask(server.url, "E1", "vm2", 1))
    assert took < TIMEOUT + SLACK
    assert answer.outcome == INVALID and "bytes" in answer.detail
    time.sleep(0.2)
    assert server.sent < 16 * 2**20, f"the client kept reading: {server.sent} bytes sent"


@pytest.mark.parametrize("behaviour", [TRICKLE_BODY, TRICKLE_HEAD], ids=["body", "head"])
def test_a_trickling_peer_is_silence_after_the_request_timeout(hostile, behaviour):
    """A byte every 50 ms (each read within requests' timeout) still ends the ask at request_timeout: unreachable."""
    server = hostile(behaviour)
    answer, took = timed(lambda: client().ask(server.url, "E1", "vm2", 1))
    assert took < TIMEOUT + SLACK
    assert answer.outcome == UNREACHABLE and answer.detail == "ExchangeTimeout"


def test_a_trickling_prometheus_holds_the_approval_within_its_timeout(hostile):
    """The Prometheus gate's query ends at its timeout (the gate then holds), however slowly the answer comes."""
    server = hostile(TRICKLE_BODY)
    gates = Gates(prometheus=PrometheusGate(url=server.url, alerts=("Down",), timeout=TIMEOUT))
    checker = GateChecker(client(), lambda name: None, lambda: {}, 2, Metrics())
    held, took = timed(lambda: checker.check(gates, "E1", ("vm1",), "vm1", False))
    assert took < TIMEOUT + SLACK
    assert held.gate == "prometheus" and "ExchangeTimeout" in held.reason


def test_an_endless_prometheus_answer_is_refused_at_its_cap(hostile):
    """Prometheus answers are capped (8 MiB): an endless one is refused, not read for ever."""
    server = hostile(endless)
    error, took = timed(lambda: client().prometheus(server.url, "/api/v1/alerts", TIMEOUT))
    assert isinstance(error, (AnswerTooLarge, ExchangeTimeout)) and took < TIMEOUT + SLACK


@pytest.mark.parametrize("behaviour", [TRICKLE_BODY, endless], ids=["trickle", "endless"])
def test_a_hostile_webhook_endpoint_fails_the_run_within_request_timeout(hostile, behaviour, tmp_path):
    """A webhook whose endpoint trickles or never ends fails after request_timeout, not after the endpoint's whim."""
    server = hostile(behaviour)
    cfg = loads(f"handlers:\n  - {{name: hook, type: webhook, url: '{server.url}/h', retries: 0, request_timeout: 1s, "
                "phases: [scheduled]}\n")
    clock = FakeClock()
    handler = instantiate(cfg.handlers, SimpleNamespace(clock=clock, store=Store(tmp_path, clock)))[0]
    result, took = timed(lambda: handler.run(context(clock, timeout=30.0)))
    assert took < TIMEOUT + SLACK
    if behaviour is endless:  # the status line came: 200, read no further than 64 KiB
        assert server.sent < 16 * 2**20
    else:
        assert result.outcome == FAILED and "ExchangeTimeout" in result.detail


def test_a_kept_connection_is_reused_after_a_whole_answer():
    """Bounded reads still keep the connection alive: two asks to a well-behaved peer use one connection."""
    accepted = []
    server = socket.create_server(("127.0.0.1", 0))
    body = b'{"ready": true, "names_self": true, "rank": 1}'

    def serve() -> None:
        conn, _ = server.accept()
        accepted.append(conn)
        with conn:
            for _ in range(2):
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    c = client()
    assert [c.ask(url, "E1", "vm2", 1).outcome for _ in range(2)] == [READY, READY]
    assert len(accepted) == 1
    server.close()


# --- finding 2: any answer means alive --------------------------------------------------------

@pytest.mark.parametrize("status", [503, 500, 401, 400])
def test_an_error_status_is_a_live_peer_that_is_not_ready(status):
    """4xx/5xx: the peer answered, so it is reachable (no takeover) and not ready."""
    answer = readiness(status, b"busy", "vm1", 0)
    assert answer.reachable and not answer.ready


@pytest.fixture
def peers():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        yield rsps


def test_a_leader_answering_503_to_every_ask_is_never_taken_over(tmp_path, clock, peers):
    """vm1 busy (503 to everything) for 10 minutes: vm2 never takes over, vm3 being ready or not."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    peers.add(responses.GET, f"{peer('vm1')}/v1/events/E1", status=503, body="busy")
    peers.add(responses.POST, f"{peer('vm1')}/v1/events/E1/peer-ready", status=503, body="busy")
    peers.add(responses.GET, f"{peer('vm3')}/v1/events/E1", json=view("vm3"))
    for _ in range(600):
        step(coord, t, "vm2")
        clock.advance(1)
    assert sent == []
    assert "not the leader" in coord.view("E1")["approval_decision"]
    assert coord.view("E1")["peers"]["vm1"]["unreachable_seconds"] == 0


def test_a_leader_that_falls_silent_is_taken_over_yet_never_approved_for(tmp_path, clock, peers):
    """Silence (connection refused) past takeover_after hands rank 1 the right to post, never vm1's
    readiness: with `wait`, no POST."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2", "vm3"])
    peers.add(responses.GET, f"{peer('vm1')}/v1/events/E1", body=ConnectionRefusedError("refused"))
    peers.add(responses.GET, f"{peer('vm3')}/v1/events/E1", json=view("vm3"))
    for _ in range(70):
        step(coord, t, "vm2")
        clock.advance(1)
    assert sent == []
    assert coord.view("E1")["acting_leader"] is None and "vm1" in coord.view("E1")["approval_decision"]


# --- finding 3: ready counts only from a peer named at its rank -------------------------------

@pytest.mark.parametrize("fields", [{"names_self": False, "rank": None}, {"names_self": True, "rank": 0},
                                    {}], ids=["not-named", "wrong-rank", "no-view"])
def test_a_peer_not_named_at_its_rank_is_not_ready(fields):
    """`ready: true` from a peer whose view does not name it at the asker's rank for it is not counted."""
    body = ('{"ready": true' + "".join(f', "{k}": {str(v).lower() if v is not None else "null"}'
                                       for k, v in fields.items()) + "}").encode()
    answer = readiness(200, body, "vm2", 1)
    assert not answer.ready and answer.outcome == INVALID and "rank 1" in answer.detail


def test_readiness_needs_ready_named_and_at_rank():
    """The one ready answer: 200, ready true, names_self true, rank as in the asker's Resources."""
    assert readiness(200, b'{"ready": true, "names_self": true, "rank": 1}', "vm2", 1).outcome == READY
    assert readiness(200, b'{"ready": false, "names_self": false}', "vm2", 1).outcome == NOT_READY


def test_the_leader_waits_for_a_peer_whose_view_does_not_name_it(tmp_path, clock, peers):
    """vm2 answers ready from a view without itself in the event: vm1 never approves on that word."""
    coord, sent, _ = make_coordinator(tmp_path, clock)
    t = tracked(clock, ["vm1", "vm2"])
    peers.add(responses.GET, f"{peer('vm2')}/v1/events/E1", json={"ready": True, "names_self": False, "rank": None})
    for _ in range(30):
        step(coord, t, "vm1")
        clock.advance(1)
    assert sent == []
    assert coord.view("E1")["peers"]["vm2"]["ready"] is False
