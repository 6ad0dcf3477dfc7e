"""The CLI never hands the operator token to a listener it has not authenticated (issue 28, MEDIUM 3), and never
reports a change the daemon's answer does not confirm."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.cli.test_cli import maintd
from tests.e2e.harness import CLEAN_ENV, free_port
from tests.imds_server import FakeImds

TOKEN = "operator-s3cret"

STRANGER = textwrap.dedent("""
    import os, socket, sys
    os.setgid(65534)
    os.setuid(65534)  # the listener is made by nobody, as a local user's would be
    if sys.argv[1].isdigit():
        listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
    else:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(sys.argv[1])
        listener.listen()
    print("listening", flush=True)
    while True:
        conn, _ = listener.accept()
        conn.settimeout(5)
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        print(repr(data), flush=True)
        body = b'{"drained": true, "already": false, "reason": "patching"}'
        conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: %d\\r\\n"
                     b"Connection: close\\r\\n\\r\\n%s" % (len(body), body))
        conn.close()
""")


def _config(write_config, tmp_path, listen: str) -> str:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    return str(write_config(f"server: {{listen: '{listen}', token_file: '{token}', "
                            f"unix_socket: '{tmp_path / 'gone' / 'maintd.sock'}'}}\n"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the listener as another user")
def test_a_listener_of_another_user_never_gets_the_token(write_config, tmp_path):
    """maintd is down and user nobody holds server.listen's port: root's `maintd drain` and `maintd status` send it
    no Authorization header (no request at all), exit non-zero and say who holds the port; no "out of rotation"."""
    port = free_port()
    stranger = subprocess.Popen([sys.executable, "-c", STRANGER, str(port)], stdout=subprocess.PIPE, text=True,
                                env=CLEAN_ENV)
    try:
        assert stranger.stdout is not None and stranger.stdout.readline().strip() == "listening"
        cfg = _config(write_config, tmp_path, f"127.0.0.1:{port}")
        for command in (["drain", "--reason", "patching"], ["status"], ["approve", "E1"]):
            done = maintd(*command, "--config", cfg)
            assert done.returncode != 0, (command, done.stdout)
            assert "uid 65534" in done.stderr and "not by maintd" in done.stderr, done.stderr
            assert "could not use the unix socket" in done.stderr
            assert "out of rotation" not in done.stdout
    finally:
        stranger.kill()
        received = stranger.communicate(timeout=10)[0]
    assert TOKEN not in received and "authorization" not in received.lower()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the listener as another user")
def test_a_unix_socket_another_user_serves_is_sent_nothing(write_config, tmp_path):
    """A stale socket path in a directory nobody owns, now served by nobody: `maintd drain` over it is refused by
    the CLI (SO_PEERCRED names uid 65534) before anything is sent, and never reported as done."""
    shared = Path(tempfile.mkdtemp())
    os.chown(shared, 65534, 65534)
    sock = shared / "maintd.sock"
    stranger = subprocess.Popen([sys.executable, "-c", STRANGER, str(sock)], stdout=subprocess.PIPE, text=True,
                                env=CLEAN_ENV)
    try:
        assert stranger.stdout is not None and stranger.stdout.readline().strip() == "listening"
        cfg = write_config(f"server: {{listen: '127.0.0.1:{free_port()}', unix_socket: '{sock}'}}\n")
        done = maintd("drain", "--reason", "patching", "--config", str(cfg))
        assert done.returncode != 0 and f"{sock} is served by uid 65534" in done.stderr, done.stderr
        assert "out of rotation" not in done.stdout
    finally:
        stranger.kill()
        received = stranger.communicate(timeout=10)[0]
        shutil.rmtree(shared)
    assert "drain" not in received


def test_a_200_that_does_not_say_the_change_was_made_is_not_reported_as_made(write_config, tmp_path):
    """A listener answers `maintd drain` and `maintd approve` with 200 `{}`: the CLI does not print "out of
    rotation" or the approval, and exits 1 saying nothing is known to have changed."""
    fake = FakeImds()
    try:
        fake.post("/v1/drain", json={})
        fake.post("/v1/events/E1/approve", json={"ok": True})
        cfg = _config(write_config, tmp_path, f"127.0.0.1:{free_port()}")
        for command in (["drain", "--reason", "patching"], ["approve", "E1"]):
            done = maintd(*command, "--config", cfg, "--url", fake.url)
            assert done.returncode == 1 and "does not say the change was made" in done.stderr, done
            assert "out of rotation" not in done.stdout and "ok" not in done.stdout
        assert [c.headers.get("authorization") for c in fake.calls] == [f"Bearer {TOKEN}"] * 2  # --url: as asked
    finally:
        fake.close()


def test_when_neither_the_socket_nor_tcp_answers_the_cli_says_why_the_socket_failed(write_config, tmp_path):
    """maintd is down: the message says the daemon is unreachable and why the unix socket could not be used."""
    cfg = _config(write_config, tmp_path, f"127.0.0.1:{free_port()}")
    done = maintd("status", "--config", cfg)
    assert done.returncode == 1 and "is it running?" in done.stderr
    assert f"could not use the unix socket {tmp_path / 'gone' / 'maintd.sock'} (No such file or directory)" \
        in done.stderr, done.stderr
