"""The maintd command as operators type it: exit codes and messages."""

from __future__ import annotations

import subprocess
import sys

from tests.e2e.harness import CLEAN_ENV, free_port


def maintd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, env=CLEAN_ENV,
                          timeout=60)


def test_version():
    done = maintd("--version")
    assert done.returncode == 0 and done.stdout.startswith("maintd ")


def test_check_config_exit_codes_and_message(write_config):
    good = write_config("imds: {poll_interval: 1s}\n")
    assert maintd("check-config", str(good)).returncode == 0
    bad = write_config("imds:\n  poll_intervall: 1s\n", "bad.yaml")
    done = maintd("check-config", str(bad))
    assert done.returncode == 1
    assert "bad.yaml:2" in done.stderr and "poll_intervall" in done.stderr and "poll_interval" in done.stderr


def test_check_config_shows_how_peers_are_reached_and_a_broken_peers_file(write_config, tmp_path):
    peers_file = tmp_path / "peers.yaml"
    peers_file.write_text("web_1: http://10.0.0.4:8088\nweb_2: http://10.0.0.5:8088\n")
    cfg = write_config(f"coordination: {{peers_file: {peers_file}, peers: {{db-1: 'http://10.0.1.4:8088'}}}}\n")
    done = maintd("check-config", str(cfg))
    assert done.returncode == 0
    assert "1 static entry" in done.stdout and f"{peers_file}: 2 entries" in done.stdout
    assert "http://{computer_name}:8088" in done.stdout
    peers_file.write_text("web_1: nope\n")
    assert "PROBLEM" in maintd("check-config", str(cfg)).stdout


def test_run_refuses_a_bad_config_with_exit_78(write_config):
    bad = write_config("handlers:\n  - {name: x, type: exce, phases: [scheduled]}\n")
    done = maintd("run", "--config", str(bad))
    assert done.returncode == 78 and "exec" in done.stderr, done.stderr


def test_run_refuses_a_group_writable_config(write_config):
    path = write_config("imds: {poll_interval: 1s}\n")
    path.chmod(0o666)
    done = maintd("run", "--config", str(path))
    assert done.returncode == 78 and "chmod go-w" in done.stderr


def test_client_commands_say_clearly_when_the_daemon_is_not_running(write_config):
    cfg = write_config(f"server: {{listen: '127.0.0.1:{free_port()}', unix_socket: null}}\n")
    for command in ("status", "events", "health", "undrain"):
        done = maintd(command, "--config", str(cfg))
        assert done.returncode != 0 and "is it running?" in done.stderr, (command, done.stderr)


def _running_server(**options):
    from agent.http.routes import ApiServer
    from agent.telemetry.metrics import Metrics
    from tests.http.test_server import FakeBackend

    backend = FakeBackend()
    srv = ApiServer(f"127.0.0.1:{free_port()}", backend, Metrics(), **options)
    srv.serve_in_background()
    return srv, backend


def test_root_cli_acts_over_the_unix_socket_and_is_journaled_by_uid(write_config, tmp_path):
    """With server.unix_socket set, `maintd drain` goes over it and the daemon knows the caller as uid 0."""
    sock = str(tmp_path / "maintd.sock")
    srv, backend = _running_server(unix_socket=sock, require_token_on_loopback=True)
    try:
        cfg = write_config(f"server: {{listen: '{srv.url[7:]}', unix_socket: '{sock}', "
                           "require_token_on_loopback: true}\n")
        done = maintd("drain", "--reason", "kernel", "--config", str(cfg))
        assert done.returncode == 0, done.stderr
        assert backend.drained == ["kernel"] and backend.by == ["uid 0 (unix socket)"]
        assert maintd("status", "--config", str(cfg)).returncode == 0
    finally:
        srv.close()


def test_root_cli_shows_the_token_file_when_loopback_needs_a_token(write_config, tmp_path):
    """Loopback needs the token (the default) and there is no unix socket: the CLI reads server.token_file itself."""
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    token.chmod(0o600)
    srv, backend = _running_server(token_reader=lambda: "t0ken", require_token_on_loopback=True)
    try:
        cfg = write_config(f"server: {{listen: '{srv.url[7:]}', token_file: '{token}', unix_socket: null}}\n")
        done = maintd("undrain", "--config", str(cfg))
        assert done.returncode == 0, done.stderr
        assert backend.by == ["127.0.0.1 (token)"]
    finally:
        srv.close()


def test_a_refused_config_is_said_with_its_line_and_exits_1(write_config):
    """`maintd status --config FILE` with a file maintd refuses says so (file:line) instead of asking the default
    addresses; the same for a --config that does not exist."""
    bad = write_config("server:\n  listen: 127.0.0.1:8088\n  unix_sockett: /tmp/x.sock\n", "bad.yaml")
    for command in ("status", "events", "fleet", "health", "drain", "watch"):
        done = maintd(command, "--config", str(bad))
        assert done.returncode == 1, (command, done.stderr)
        assert "config refused" in done.stderr and "bad.yaml:3" in done.stderr, (command, done.stderr)
        assert "/run/maintd/maintd.sock" not in done.stderr and "8088" not in done.stderr, done.stderr
    missing = maintd("status", "--config", str(bad.parent / "nope.yaml"))
    assert missing.returncode == 1 and "nope.yaml: no such file" in missing.stderr, missing.stderr
