"""The HTTP server under hostile clients: nobody starves the probe, trickling buys nothing, bad bodies are 400s,
peers read readiness only, and the server neither wakes while idle nor lingers at shutdown."""

from __future__ import annotations

import os
import resource
import socket
import statistics
import threading
import time
from pathlib import Path

import pytest

from agent.http.auth import socket_caller_ok
from agent.http.routes import ApiServer
from agent.telemetry.metrics import Metrics
from tests.http.test_server import AUTH, TOKEN, FakeBackend, session, url


def start(backend: FakeBackend | None = None, **options) -> tuple[ApiServer, FakeBackend, int]:
    backend = backend or FakeBackend()
    options = {"token_reader": lambda: TOKEN, "max_body_bytes": 2048, "read_timeout": 0.5, **options}
    srv = ApiServer("0.0.0.0:0", backend, Metrics(), **options)
    srv.serve_in_background()
    return srv, backend, srv.socket.getsockname()[1]


@pytest.fixture
def servers():
    started: list[ApiServer] = []

    def make(backend: FakeBackend | None = None, **options) -> tuple[ApiServer, FakeBackend, int]:
        started.append(start(backend, **options)[0])
        return started[-1], started[-1].router.backend, started[-1].socket.getsockname()[1]

    yield make
    for srv in started:
        srv.close()


def connect(port: int, source: str = "127.0.0.2") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def raw(port: int, data: bytes, source: str = "127.0.0.1") -> bytes:
    """Send `data`, return everything the server answers until it closes."""
    with connect(port, source) as s:
        s.settimeout(3)
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def probe_seconds(port: int) -> float:
    """How long one probe from 127.0.0.1 on a new connection takes to be answered 200."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"GET /probe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    return time.monotonic() - t0


def closed_by_server(s: socket.socket, within: float) -> bytes | None:
    """What the server sent before closing `s` within `within` seconds; None when it kept it open."""
    s.settimeout(within)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def test_the_probe_never_waits_behind_1000_slow_connections_trickling(servers):
    """1000 connections from 127.0.0.2 trickling a request byte by byte: the probe from 127.0.0.1
    answers fast throughout, never after waiting for a slow connection (their read_timeout is 30 s).
    The bounds are a loaded CI host's (median < 250 ms, none over 1 s); the typical figure is a bench's
    (`python -m bench probe_flood`, docs/PERFORMANCE.md)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    srv, _, port = servers(read_timeout=30, per_client=2000)
    slow = [connect(port) for _ in range(1000)]
    try:
        for s in slow:
            s.sendall(b"GET /v1/status HTTP/1.1\r\n")
        latencies = []
        for round_ in range(20):
            for s in slow[round_ % 4::4]:
                s.sendall(b"X")  # one byte of a header that never ends
            latencies.append(probe_seconds(port))
            time.sleep(0.05)
        assert srv.loop.connections >= 1000
        assert statistics.median(latencies) < 0.25 and max(latencies) < 1.0, latencies
    finally:
        for s in slow:
            s.close()


def dropped(srv: ApiServer, reason: str) -> float:
    """maintd_http_connections_dropped_total{reason} as exported."""
    line = f'maintd_http_connections_dropped_total{{reason="{reason}"}} '
    return float(next(x for x in srv.metrics.render().decode().splitlines() if x.startswith(line)).split()[-1])


def test_a_trickling_request_is_closed_at_the_whole_request_deadline(servers, logs):
    """One byte every 100 ms keeps no connection past server.read_timeout (0.5 s): it gets a 408 and is closed."""
    srv, _, port = servers()
    s = connect(port)
    start_ = time.monotonic()
    answer = b""
    for byte in b"GET /probe HTTP/1.1\r\nX-Slow: " + b"a" * 30:
        try:
            s.sendall(bytes([byte]))
        except OSError:
            break
        s.settimeout(0.1)
        try:
            answer = s.recv(4096)
            break
        except TimeoutError:
            pass
    elapsed = time.monotonic() - start_
    s.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"Connection: close" in answer
    assert elapsed < 1.5
    assert dropped(srv, "request_timeout") == 1
    assert [e["reason"] for e in logs if e["event"] == "http.connection_dropped"] == ["request_timeout"]


def test_a_client_address_holds_at_most_its_share_of_connections(servers):
    """Past server.max_connections_per_client, one address's new connections are closed at once; others still get in."""
    srv, _, port = servers(per_client=4, read_timeout=10)
    held = [connect(port) for _ in range(4)]
    extra = connect(port)
    assert closed_by_server(extra, 1.0) == b""
    assert dropped(srv, "per_client") == 1
    assert all(closed_by_server(s, 0.05) is None for s in held)
    local = [connect(port, "127.0.0.1") for _ in range(3)]
    assert all(closed_by_server(s, 0.05) is None for s in local)
    assert probe_seconds(port) < 1  # this host's fourth
    deadline = time.monotonic() + 2
    while srv.loop.connections > 7 and time.monotonic() < deadline:  # the probe's own close has been seen
        time.sleep(0.01)
    local += [connect(port, "127.0.0.1"), connect(port, "127.0.0.1")]
    assert closed_by_server(local[-1], 1.0) == b"" and dropped(srv, "per_client") == 2
    for s in held + local + [extra]:
        s.close()


def test_when_full_a_new_connection_replaces_the_oldest_idle_one(servers):
    """At server.max_connections, the LB's probe from a new address still gets in: the oldest idle connection goes."""
    srv, _, port = servers(max_connections=16, per_client=100, read_timeout=10)
    idle = [connect(port) for _ in range(srv.loop.max_connections)]
    time.sleep(0.1)
    with connect(port, "127.0.0.3") as lb:
        lb.settimeout(2)
        lb.sendall(b"GET /probe HTTP/1.1\r\nHost: x\r\n\r\n")
        assert lb.recv(4096).startswith(b"HTTP/1.1 200")
    assert closed_by_server(idle[0], 1.0) == b""
    assert dropped(srv, "evicted") == 1
    for s in idle:
        s.close()


def test_the_probe_is_answered_while_every_worker_is_busy(servers):
    """Slow /v1 answers (a backend lock held) do not delay the probe: it is answered on the loop."""
    gate = threading.Event()

    class Stuck(FakeBackend):
        def status(self):
            gate.wait(5)
            return {"vm_name": "vm1"}

    _, _, port = servers(Stuck())
    blocked = [threading.Thread(target=lambda: session().get(url(port, "/v1/status"), timeout=10)) for _ in range(8)]
    for t in blocked:
        t.start()
    time.sleep(0.2)
    try:
        assert probe_seconds(port) < 1.0  # the LB probe's timeout
        assert session().get(url(port, "/healthz"), timeout=1).status_code == 200
    finally:
        gate.set()
        for t in blocked:
            t.join()


def test_a_deeply_nested_body_is_a_400_not_a_500(servers):
    """[[[[...]]]] 1000 levels deep is refused as bad JSON; the server goes on."""
    _, backend, port = servers()
    r = session().post(url(port, "/v1/health/reports"), data=b"[" * 1000 + b"]" * 1000, headers=AUTH)
    assert r.status_code == 400 and "nested" in r.json()["error"]
    assert backend.reports == [] and session().get(url(port, "/healthz")).status_code == 200


@pytest.mark.parametrize("lengths", [(b"5", b"5"), (b"5", b"7"), (b"5, 5",), (b"+5",), (b"0x5",)])
def test_an_ambiguous_content_length_is_a_400(servers, lengths):
    """Two Content-Length headers (even equal) or one that is not plain digits: 400 and the connection is closed."""
    _, backend, port = servers()
    head = b"POST /v1/drain HTTP/1.1\r\nHost: x\r\n" + b"".join(b"Content-Length: " + n + b"\r\n" for n in lengths)
    answer = raw(port, head + b"\r\n{}   ")
    assert answer.startswith(b"HTTP/1.1 400") and backend.drained == []


def test_chunked_bodies_are_411_and_huge_request_lines_414(servers):
    """Transfer-Encoding is refused (411); a request line over 8 KiB is 414."""
    _, _, port = servers()
    assert raw(port, b"POST /v1/drain HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"0\r\n\r\n").startswith(b"HTTP/1.1 411")
    assert raw(port, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 414")


def test_an_http_1_0_probe_without_host_is_answered_and_closed(servers):
    """A bare `GET /probe HTTP/1.0` (some load balancers) gets its 200 and the connection is closed."""
    _, _, port = servers()
    answer = raw(port, b"GET /probe HTTP/1.0\r\n\r\n", "127.0.0.2")
    assert answer.startswith(b"HTTP/1.1 200") and b"Connection: close" in answer and answer.endswith(b"OK\n")


def test_pipelined_keep_alive_requests_are_answered_in_order(servers):
    """Two requests in one packet on a kept-alive connection: two answers, in order; HEAD has no body."""
    _, _, port = servers()
    with connect(port, "127.0.0.1") as s:
        s.settimeout(10)  # a hang guard only: 2 s timed out on a loaded host before the answers came
        s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"HEAD /probe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    first, _, second = data.partition(b"HTTP/1.1 200 OK\r\nServer: maintd\r\nContent-Type: text/plain")
    assert first.startswith(b"HTTP/1.1 200") and b'"vm_name": "vm1"' in first
    assert b"Content-Length: 3" in second and second.endswith(b"\r\n\r\n")


def test_expect_100_continue_gets_the_go_ahead(servers):
    """curl's `Expect: 100-continue` for larger bodies is answered, so the client does not stall a second."""
    _, backend, port = servers()
    with connect(port, "127.0.0.1") as s:
        s.settimeout(2)
        s.sendall(b"POST /v1/drain HTTP/1.1\r\nHost: x\r\nContent-Length: 17\r\nExpect: 100-continue\r\n"
                  b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
        assert s.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b'{"reason": "k8s"}')
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    assert backend.drained == ["k8s"]


def test_peers_read_readiness_only(servers):
    """Without the server token, another address sees an event's readiness and health states, never hook output."""
    _, backend, port = servers()
    remote = session("127.0.0.2")
    event = remote.get(url(port, "/v1/events/E1")).json()
    assert event == {"EventId": "E1", "EventStatus": "Scheduled", "rank": 1, "ready": True}
    health = remote.get(url(port, "/v1/health")).json()
    assert health["HealthEvents"] == [{"SourceId": "app", "Property": "db", "HealthState": "Ok", "IsExpired": False}]
    assert remote.get(url(port, "/v1/status")).status_code == 403
    assert remote.get(url(port, "/v1/events")).status_code == 403
    backend.peer_token = "peer"
    assert remote.get(url(port, "/v1/events/E1"), headers={"Authorization": "Bearer peer"}).json()["ready"] is True
    assert "results" not in remote.get(url(port, "/v1/events/E1"), headers={"Authorization": "Bearer peer"}).json()
    operator = remote.get(url(port, "/v1/events/E1"), headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert operator["results"][0]["output"] == "db_password=hunter2"
    assert "hunter2" in session().get(url(port, "/v1/health")).text


def test_loopback_callers_show_the_token_to_act_by_default(servers):
    """server.require_token_on_loopback (the default): a drain from 127.0.0.1 needs the token; reads do not."""
    _, backend, port = servers()
    local = session()
    assert local.post(url(port, "/v1/drain"), json={"reason": "x"}).status_code == 401
    assert local.post(url(port, "/v1/events/E1/approve"), headers={"Authorization": "Bearer nope"}).status_code == 403
    r = local.post(url(port, "/v1/drain"), json={"reason": "x"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and backend.by == ["127.0.0.1 (token)"]
    assert local.get(url(port, "/v1/status")).status_code == 200


def unix_request(path: str, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_the_unix_socket_names_the_caller_by_uid(servers, tmp_path: Path):
    """server.unix_socket: root's drain is recorded as uid 0; the socket file is not open to others."""
    sock = str(tmp_path / "maintd.sock")
    _, backend, port = servers(unix_socket=sock)
    assert os.stat(sock).st_mode & 0o777 == 0o660
    answer = unix_request(sock, b"POST /v1/drain HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and backend.by == ["uid 0 (unix socket)"]
    assert b'"vm_name"' in unix_request(sock, b"GET /v1/status HTTP/1.1\r\nConnection: close\r\n\r\n")


def test_only_root_maintds_user_and_the_group_may_use_the_unix_socket():
    """Peer credentials: uid 0 and maintd's own uid always, others only as members of server.unix_socket_group."""
    assert socket_caller_ok(0, 0, None, own_uid=999)
    assert socket_caller_ok(999, 999, None, own_uid=999)
    assert not socket_caller_ok(65534, 65534, None, own_uid=0)
    assert socket_caller_ok(65534, 0, "root", own_uid=0)  # primary group
    assert not socket_caller_ok(65534, 65534, "root", 0) and not socket_caller_ok(65534, 65534, "no-such-group", 0)


def voluntary_switches(tid: int) -> int:
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def test_an_idle_server_does_not_wake_up(servers):
    """With no client, the server thread sleeps until one comes: no wake-ups in 2 s."""
    srv, _, port = servers()
    assert session().get(url(port, "/probe")).status_code == 200
    # the keep-alive connection above reaches its deadline and is closed (waited for: a fixed 0.7 s could end
    # before a starved loop on a loaded host got to it, and its wake-ups then fell in the measured 2 s)
    deadline = time.monotonic() + 10
    while srv.loop.connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.loop.connections == 0
    tid = srv.loop.native_id
    assert tid is not None
    before = voluntary_switches(tid)
    time.sleep(2)
    assert voluntary_switches(tid) - before <= 1


def test_close_stops_the_server_within_a_second(servers):
    """Shutdown with idle and mid-request connections open: close() returns within a second; the port is shut."""
    srv, _, port = servers(read_timeout=30)
    open_ = [connect(port) for _ in range(50)]
    open_[0].sendall(b"GET /probe HTTP/1.1\r\n")
    t0 = time.monotonic()
    srv.close()
    assert time.monotonic() - t0 < 1.0
    assert closed_by_server(open_[1], 1.0) is not None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
    for s in open_:
        s.close()


def test_socket_activation_overriding_server_listen_is_logged(logs):
    """systemd's maintd.socket wins over server.listen, and the log says so (server.listen_overridden)."""
    activated = socket.socket()
    activated.bind(("127.0.0.1", 0))
    activated.listen(8)
    address = f"127.0.0.1:{activated.getsockname()[1]}"
    srv = ApiServer("0.0.0.0:8088", FakeBackend(), Metrics(), sock=activated)
    try:
        srv.serve_in_background()
        assert session().get(f"{srv.url}/probe").status_code == 200
    finally:
        srv.close()
    [entry] = [e for e in logs if e["event"] == "server.listen_overridden"]
    assert (entry["listen"], entry["socket"]) == ("0.0.0.0:8088", address)


@pytest.mark.parametrize("reports", [
    [{"SourceId": "app", "Property": "db", "HealthState": "Error", "Description": "x"}],
    [{"SourceId": "app", "Property": "db", "HealthState": "Warning", "Description": "x"}],
    [{"SourceId": "maintd", "Property": "maintenance/E1", "HealthState": "Error", "Description": "x"}],
    [{"SourceId": "app", "Property": "db", "HealthState": "Ok", "IsExpired": True, "Description": "x"}],
    [{"SourceId": "app", "Property": "db", "HealthState": "Ok"}],
])
def test_the_peer_health_view_gives_the_fleet_gate_the_same_verdict(reports):
    """A peer's fleet gate reads the readiness-only /v1/health and decides as it would on the full one."""
    from agent.coordination.approval_gates import peer_state
    from agent.http.auth import peer_health_view

    full = {"AggregatedHealthState": "Ok", "HealthEvents": reports}
    for warning_as_error in (False, True):
        assert peer_state(peer_health_view(full), "E1", warning_as_error) == peer_state(full, "E1", warning_as_error)
    assert "Description" not in str(peer_health_view(full))


def test_a_bug_on_the_loop_costs_one_connection_not_the_server(servers, logs):
    """An exception while the loop handles a connection is logged (http.internal_error): that connection gets a 500
    and is closed; the probe keeps answering."""
    srv, _, port = servers()
    real = srv.router.cheap
    srv.router.cheap = lambda request: 1 / 0 if request.target == "/boom" else real(request)
    answer = raw(port, b"GET /boom HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 500") and answer.count(b"HTTP/1.1") == 1
    assert probe_seconds(port) < 1
    assert any(e["event"] == "http.internal_error" for e in logs)
