"""Secure by default for local users (issue 24): mutations need the unix socket (uid by SO_PEERCRED) or the
token, a tokenless loopback caller is told how to proceed, and the socket can be neither reached by other users
nor stolen or swapped."""

from __future__ import annotations

import grp
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config.config import DEFAULT_UNIX_SOCKET, ServerConfig, load, loads
from agent.errors import ConfigError
from agent.http.auth import how_to_act
from agent.http.listeners import listen_unix
from agent.http.routes import ApiServer
from agent.telemetry.metrics import Metrics
from tests.cli.test_cli import maintd
from tests.e2e.harness import free_port
from tests.http.test_server import TOKEN, FakeBackend, session, url

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
DRAIN = b"POST /v1/drain HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@pytest.fixture
def serve() -> Iterator:
    """A server whose socket sits in a directory like /run/maintd: root's, mode 0755, so only the socket's own
    mode and SO_PEERCRED decide who gets in (pytest's tmp_path is 0700, which would keep every other uid out)."""
    started: list[ApiServer] = []
    run = tempfile.mkdtemp(prefix="maintd-run-")
    os.chmod(run, 0o755)

    def start(**options) -> tuple[ApiServer, FakeBackend, str]:
        backend = FakeBackend()
        sock = os.path.join(run, "maintd.sock")
        srv = ApiServer(f"127.0.0.1:{free_port()}", backend, Metrics(), token_reader=lambda: TOKEN,
                        unix_socket=sock, **options)
        srv.serve_in_background()
        started.append(srv)
        return srv, backend, sock

    yield start
    for srv in started:
        srv.close()
    shutil.rmtree(run)


def status_line(answer: bytes) -> str:
    return answer.split(b"\r\n", 1)[0].decode()


def as_user(uid: int, gid: int, sock: str, request: bytes) -> str:
    """The status line a process running as uid/gid (no supplementary groups) gets on `sock`, or the error
    naming why it could not connect. Forked, so the child needs no interpreter it may read."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid/gid, ask once, report, leave without cleanup
        result = b"?"
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(3)
                s.connect(sock)
                s.sendall(request)
                result = s.recv(4096).split(b"\r\n", 1)[0]
        except OSError as exc:
            result = type(exc).__name__.encode()
        finally:
            os.write(write_end, result)
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as f:
        return f.read().decode()


def test_the_defaults_and_the_shipped_config_are_secure():
    """Out of the box: loopback needs the token to act, the unix socket is /run/maintd/maintd.sock, and the unit
    makes its directory."""
    shipped = load(ROOT / "config" / "maintd.yaml", check_perms=False).server
    for server in (ServerConfig(), loads("{}").server, shipped):
        assert server.require_token_on_loopback is True and server.unix_socket == DEFAULT_UNIX_SOCKET
    unit = (ROOT / "systemd" / "maintd.service").read_text()
    assert f"RuntimeDirectory={Path(DEFAULT_UNIX_SOCKET).parent.name}\n" in unit


def test_a_tokenless_loopback_drain_is_401_with_the_way_forward(serve):
    """127.0.0.1 without the token: 401 naming the unix socket, sudo, curl, the token and the opt-out key; with
    the token it is done; reads from loopback stay open."""
    srv, backend, sock = serve()
    port = srv.socket.getsockname()[1]
    r = session().post(url(port, "/v1/events/E1/approve"))
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer" and backend.by == []
    error = r.json()["error"]
    for how in (sock, "sudo maintd", f"curl --unix-socket {sock}", "Authorization: Bearer",
                "server.require_token_on_loopback: false"):
        assert how in error, (how, error)
    assert session().get(url(port, "/v1/status")).status_code == 200
    r = session().post(url(port, "/v1/drain"), json={"reason": "x"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and backend.by == ["127.0.0.1 (token)"]


def test_a_remote_caller_is_told_only_about_the_token():
    """The socket is no way forward from another host: the 401 there names the token, not the socket."""
    message = how_to_act("/run/maintd/maintd.sock", loopback=False)
    assert "token_file" in message and "unix" not in message and "require_token_on_loopback" not in message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as root and as another uid")
def test_root_acts_over_the_socket_and_another_uid_is_refused(serve):
    """Root's drain over the socket is done; uid 65534 cannot even connect (mode 0660); with the file opened to
    all by mistake, SO_PEERCRED still refuses it (403)."""
    _, backend, sock = serve()
    assert status_line(_unix(sock, DRAIN)) == "HTTP/1.1 200 OK" and backend.by == ["uid 0 (unix socket)"]
    assert as_user(NOBODY, NOBODY, sock, DRAIN) == "PermissionError"
    os.chmod(sock, 0o666)
    assert as_user(NOBODY, NOBODY, sock, DRAIN) == "HTTP/1.1 403 Forbidden"
    assert backend.drained == ["manual drain"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_member_of_the_socket_group_may_act(serve):
    """server.unix_socket_group: the socket file belongs to the group, and its members' drains are done."""
    group = grp.getgrgid(NOBODY).gr_name
    _, backend, sock = serve(unix_socket_group=group)
    assert os.stat(sock).st_gid == NOBODY and os.stat(sock).st_mode & 0o777 == 0o660
    assert as_user(NOBODY, NOBODY, sock, DRAIN) == "HTTP/1.1 200 OK"
    assert backend.by == [f"uid {NOBODY} (unix socket)"]


def _unix(sock: str, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(3)
        s.connect(sock)
        s.sendall(request)
        return s.recv(4096)


def test_a_second_server_never_steals_a_live_socket(serve):
    """A socket another process still serves is refused (is maintd already running?), and the first keeps it."""
    _, _, sock = serve()
    with pytest.raises(OSError, match="another process serves it"):
        listen_unix(sock, None)
    assert status_line(_unix(sock, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")) == "HTTP/1.1 200 OK"


def test_a_stale_socket_is_replaced_and_other_files_are_left_alone(tmp_path: Path):
    """A socket nobody serves (maintd was killed) is replaced; a regular file at the path is refused, untouched."""
    run = tmp_path / "run"
    run.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(run / "a.sock"))
    stale.close()
    listen_unix(str(run / "a.sock"), None).close()
    (run / "b.sock").write_text("not a socket")
    with pytest.raises(OSError, match="server.unix_socket .*b.sock: it exists and is not a socket"):
        listen_unix(str(run / "b.sock"), None)
    assert (run / "b.sock").read_text() == "not a socket"


def test_a_file_another_thread_writes_while_the_socket_is_bound_keeps_its_mode(tmp_path: Path, monkeypatch):
    """Binding the socket (at start and on a reload) leaves the process's umask alone: a state file or directory
    the loop writes at that moment gets its usual mode (the socket itself is 0660 before anyone can connect)."""
    made: list[int] = []
    bind = socket.socket.bind

    def bind_while_another_thread_writes(self: socket.socket, address: object) -> None:
        bind(self, address)
        (tmp_path / "state.d").mkdir(mode=0o755)
        made.append(os.stat(tmp_path / "state.d").st_mode & 0o777)

    monkeypatch.setattr(socket.socket, "bind", bind_while_another_thread_writes)
    old = os.umask(0o022)
    try:
        listen_unix(str(tmp_path / "maintd.sock"), None).close()
    finally:
        os.umask(old)
    assert made == [0o755]
    assert os.stat(tmp_path / "maintd.sock").st_mode & 0o777 == 0o660


def test_a_socket_directory_others_may_write_is_refused(tmp_path: Path):
    """In a directory another user could write, the socket could be swapped for someone else's: refused."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(OSError, match="writable by others"):
        listen_unix(str(shared / "maintd.sock"), None)
    assert not (shared / "maintd.sock").exists()


def test_a_socket_path_too_long_for_the_kernel_is_a_config_error():
    """sun_path holds 107 bytes: a longer server.unix_socket is refused at load, not at bind."""
    with pytest.raises(ConfigError, match="server.unix_socket: .*at most 107 bytes"):
        loads("server: {unix_socket: /" + "x" * 120 + "}")


def test_the_cli_falls_back_to_tcp_and_says_why_the_socket_was_not_used(write_config, tmp_path: Path):
    """No usable socket (here: none at the path): reads work over TCP; a drain's 401 is shown with the server's
    way forward and why the CLI could not use the socket."""
    srv = ApiServer(f"127.0.0.1:{free_port()}", FakeBackend(), Metrics(), token_reader=lambda: TOKEN)
    srv.serve_in_background()
    missing = tmp_path / "gone" / "maintd.sock"
    try:
        cfg = write_config(f"server: {{listen: '{srv.url[7:]}', unix_socket: '{missing}'}}\n")
        assert maintd("status", "--config", str(cfg)).returncode == 0
        done = maintd("drain", "--config", str(cfg))
        assert done.returncode == 1 and "answered 401" in done.stderr and "server.token_file" in done.stderr
        assert f"could not use the unix socket {missing} (No such file or directory)" in done.stderr
    finally:
        srv.close()
