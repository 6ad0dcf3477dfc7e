"""The CLI reaches its own daemon wherever `server.listen` puts it (issue 35 #4): a real maintd on 127.0.0.77 (and
on this host's interface address, when it has one) with no unix socket; `maintd status` and `maintd fleet
--history` talk to it over TCP, the token sent once the kernel names root as the listener's owner."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.harness import CLEAN_ENV, free_port
from tests.http.test_listener_owner import _interface_address

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("host", ["127.0.0.77", "interface"])
def test_status_and_fleet_history_reach_a_daemon_listening_off_127_0_0_1(start_emulator, start_agent, host):
    if host == "interface":
        found = _interface_address()
        if found is None:
            pytest.skip("this host has no address but loopback")
        host = found
    emu = start_emulator(["vm-1"])
    port = free_port()
    agent = start_agent(emu, "vm-1", {"server": {"listen": f"{host}:{port}", "unix_socket": None}}, port=port)

    def maintd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agent", *args, "--config", str(agent.config_path)],
                              capture_output=True, text=True, env=CLEAN_ENV, timeout=30)

    status = maintd("status")
    assert status.returncode == 0, status.stderr
    assert " on vm-1" in status.stdout and "does not name" not in status.stderr
    history = maintd("fleet", "--history")
    assert "does not name" not in history.stderr and "not by maintd" not in history.stderr
    assert "azure_blob" in history.stdout + history.stderr  # the peer backend keeps no history: the daemon said so
    drained = maintd("drain", "--reason", "over TCP with the token")
    assert drained.returncode == 0, drained.stderr  # the token went: the kernel named root as the listener's owner
    assert agent.get("/probe").status_code == 503
