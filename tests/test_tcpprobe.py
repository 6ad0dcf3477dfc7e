"""probe.mode: tcp — the port accepts while in rotation and refuses while out."""

from __future__ import annotations

import socket

from agent.tcpprobe import TcpProbe


def connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except ConnectionRefusedError:
        return False


def test_port_follows_rotation_and_refuses_while_drained():
    state = {"in": True}
    probe = TcpProbe("127.0.0.1:0", lambda: state["in"])
    probe.step()
    assert probe.listening and connects(probe.port)
    probe.step()  # accepts and closes the waiting connection

    state["in"] = False
    probe.step()
    assert not probe.listening
    assert not connects(probe.port), "a drained VM must refuse the LB's TCP probe at once"

    state["in"] = True
    probe.step()
    assert connects(probe.port), "back in rotation: the same port accepts again"
    probe.stop()


def test_served_on_a_thread_until_stopped():
    probe = TcpProbe("127.0.0.1:0", lambda: True)
    probe.start()
    try:
        assert connects(probe.port)
    finally:
        probe.stop()
    assert not connects(probe.port)


def test_a_port_in_use_is_logged_not_raised(logs):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        probe = TcpProbe(f"127.0.0.1:{holder.getsockname()[1]}", lambda: True)
        probe.step()
        assert not probe.listening
        assert any(e["event"] == "probe.tcp_bind_failed" for e in logs)
    finally:
        holder.close()

