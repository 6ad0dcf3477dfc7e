"""The CLI finds its own daemon's listener at any address of this host (issue 35 #4): `PeerOwners.listener` names
the owner of the daemon's end of a connection to 127.0.0.0/8, ::1, a wildcard's loopback or an interface's
address, by sock_diag and by the /proc/net/tcp scan alike; when it names nobody it says why."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from agent.http.peer_owner import PeerOwners, is_local_address


def _interface_address() -> str | None:
    """This host's address on its default route, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address: str = probe.getsockname()[0]
        return None if address.startswith("127.") else address


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _connected(bind: str, connect: str, dual_stack: bool = False) -> Iterator[socket.socket]:
    """A client socket connected to a listener bound to `bind` (its accepted end held open)."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family) as listener:
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual_stack else 1)
        listener.bind((bind, 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection((connect, port), timeout=5) as client:
            accepted, _ = listener.accept()
            with accepted:
                yield client


CASES = [("127.0.0.77", "127.0.0.77", False), ("0.0.0.0", "127.0.0.1", False), ("0.0.0.0", "127.0.0.77", False)]
if _ipv6():
    CASES += [("::1", "::1", False), ("::", "127.0.0.1", True), ("::", "::1", True)]
if (own := _interface_address()) is not None:
    CASES += [(own, own, False), ("0.0.0.0", own, False)]


@pytest.mark.parametrize("netlink", [True, False], ids=["sock_diag", "proc-net-tcp"])
@pytest.mark.parametrize("bind, connect, dual_stack", CASES)
def test_the_listener_at_any_address_of_this_host_is_named_by_its_owner(bind: str, connect: str, dual_stack: bool,
                                                                       netlink: bool) -> None:
    owners = PeerOwners()
    owners.netlink = netlink
    with _connected(bind, connect, dual_stack) as client:
        assert owners.listener(client) == (os.geteuid(), "")


STRANGER = textwrap.dedent("""
    import os, socket, sys
    os.setgid(65534)
    os.setuid(65534)
    listener = socket.create_server(("127.0.0.77", 0))
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    conn.recv(1)
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the listener as another user")
def test_another_users_listener_at_127_0_0_77_is_named_as_theirs() -> None:
    stranger = subprocess.Popen([sys.executable, "-c", STRANGER], stdout=subprocess.PIPE, text=True)
    try:
        assert stranger.stdout is not None
        port = int(stranger.stdout.readline())
        with socket.create_connection(("127.0.0.77", port), timeout=5) as client:
            for netlink in (True, False):
                owners = PeerOwners()
                owners.netlink = netlink
                assert owners.listener(client).uid == 65534
    finally:
        stranger.kill()
        stranger.wait()


class _Seen:
    """A connection as the lookup sees it: two ends, nothing behind them."""

    def __init__(self, own: tuple[str, int], peer: tuple[str, int]) -> None:
        self.own, self.peer = own, peer

    def getsockname(self) -> tuple[str, int]:
        return self.own

    def getpeername(self) -> tuple[str, int]:
        return self.peer


def test_when_the_kernel_names_nobody_the_reason_is_precise(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Another host's address; a local address no socket of this namespace holds (a forwarder's); a kernel that
    cannot be asked at all."""
    assert is_local_address(__import__("ipaddress").ip_address("127.0.0.77"))
    assert not is_local_address(__import__("ipaddress").ip_address("192.0.2.1"))
    remote = PeerOwners().listener(_Seen(("10.255.0.1", 40000), ("192.0.2.1", 8088)))  # type: ignore[arg-type]
    assert remote.uid is None and "192.0.2.1 is not an address of this host" in remote.problem
    forwarded = PeerOwners().listener(_Seen(("127.0.0.1", 1), ("127.0.0.1", 2)))  # type: ignore[arg-type]
    assert forwarded.uid is None and "no socket of this host's network namespace" in forwarded.problem
    blind = PeerOwners(proc_net=str(tmp_path / "none"))
    blind.netlink = False
    asked = blind.listener(_Seen(("127.0.0.1", 1), ("127.0.0.1", 2)))  # type: ignore[arg-type]
    assert asked.uid is None and "could not be asked" in asked.problem and "tcp6 unreadable" in asked.problem
