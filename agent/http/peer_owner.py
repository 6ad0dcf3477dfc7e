"""Who owns the other end of a TCP connection within this host: the kernel knows, since both ends are its sockets.

Asked by `sock_diag` netlink (an exact lookup of one socket by its four-tuple: a single message, whatever the
number of sockets), or, where that is not available, by a scan of /proc/net/tcp(6) (the line whose local end
is the peer's address and port carries its owner's uid). An IPv4 connection to a dual-stack listener (`[::]`)
ends in an IPv6 socket with IPv4-mapped addresses: both are looked up.

Two askers: the server (`uid`) counts a client from 127.0.0.1 or ::1 by its owner (other clients, other
127.0.0.0/8 sources included, are counted by address); the CLI (`listener`) asks who holds the daemon's end
of its connection, at whatever address of this host the daemon listens (127.0.0.0/8, ::1, an interface's
address, behind a wildcard bind), and when the kernel names nobody, why (`Listener.problem`).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from typing import NamedTuple

__all__ = ["Listener", "PeerOwners"]

_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NETLINK_SOCK_DIAG = 4
_NO_COOKIE = 0xFFFFFFFF
_UID_AT = 16 + 4 + 48 + 12
"""Offset of `idiag_uid` in the answer: netlink header, then inet_diag_msg's four bytes, its socket id, and
expires, rqueue and wqueue."""
_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_THIS_HOST = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
"""The sources looked up: this host's own. Other 127.0.0.0/8 sources are counted by address, like any
other client (they are how port forwarders and other network namespaces arrive, and how tests play remote hosts)."""


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _local(addr: Address) -> Address | None:
    """`addr` as the peer's own socket holds it (an IPv4-mapped one as IPv4), when it is a loopback address."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return addr if any(addr in net for net in _LOOPBACK) else None


class Listener(NamedTuple):
    """Who holds the daemon's end of the CLI's connection: its uid, or None and why the kernel names nobody."""

    uid: int | None
    problem: str = ""


def _forms(addr: Address) -> list[Address]:
    """The ways a socket of this host may hold `addr`: as it is, and an IPv4 address also IPv4-mapped (a socket
    accepted by a dual-stack `[::]` listener)."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    if isinstance(addr, ipaddress.IPv4Address):
        return [addr, ipaddress.IPv6Address(f"::ffff:{addr}")]
    return [addr]


def _address(host: str) -> Address:
    return ipaddress.ip_address(host.split("%", 1)[0])


def is_local_address(addr: Address) -> bool:
    """Whether `addr` is an address of this host (a bind to it succeeds: 127.0.0.0/8, ::1, an interface's)."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(addr), 0))
    except OSError as exc:
        return exc.errno != errno.EADDRNOTAVAIL
    return True


class PeerOwners:
    """Looks up the uid owning the peer end of TCP connections between two sockets of this host."""

    def __init__(self, proc_net: str = "/proc/net") -> None:
        self.proc_net = proc_net
        self.netlink = True
        """False once sock_diag answered that it is not available here: /proc/net/tcp from then on."""
        self.netlink_error = ""

    def uid(self, sock: socket.socket) -> int | None:
        """The uid owning the other end of `sock`, when it comes from 127.0.0.1 or ::1 on this host; else None."""
        try:
            peer_host, peer_port = sock.getpeername()[:2]
            own_host, own_port = sock.getsockname()[:2]
            peer = _local(_address(peer_host))
            peer = peer if peer in _THIS_HOST else None
            own = _local(_address(own_host))
        except (OSError, ValueError):
            return None
        if peer is None or own is None:
            return None
        return self._lookup(peer, peer_port, own, own_port)

    def listener(self, sock: socket.socket) -> Listener:
        """Who holds the other end of the CLI's connection `sock` (the daemon's accepted socket, which belongs to
        the listener's owner), whatever address of this host it listens on; when nobody, why precisely."""
        try:
            peer_host, peer_port = sock.getpeername()[:2]
            own_host, own_port = sock.getsockname()[:2]
            peer, own = _address(peer_host), _address(own_host)
        except (OSError, ValueError) as exc:
            return Listener(None, f"the connection has no address to look up ({exc})")
        uid = self._lookup(peer, peer_port, own, own_port)
        if uid is not None:
            return Listener(uid)
        if not is_local_address(peer):
            return Listener(None, f"{peer} is not an address of this host, so its kernel cannot name the process "
                                  "behind it (ask with --url to trust that address)")
        if not self.netlink and not self._readable():
            return Listener(None, f"the kernel could not be asked (sock_diag: {self.netlink_error or 'unavailable'}; "
                                  f"{self.proc_net}/tcp and tcp6 unreadable)")
        return Listener(None, f"no socket of this host's network namespace holds the other end of the connection to "
                              f"{peer}:{peer_port}: it is forwarded to another namespace (a container, a proxy such "
                              "as docker-proxy), whose process the kernel does not name here")

    def _lookup(self, peer: Address, peer_port: int, own: Address, own_port: int) -> int | None:
        """The uid of the socket whose local end is (peer, peer_port) and remote end (own, own_port), in either form."""
        for p, o in zip(_forms(peer), _forms(own), strict=True):
            if self.netlink:
                try:
                    uid = self._ask_kernel(p, peer_port, o, own_port)
                except OSError as exc:
                    self.netlink, self.netlink_error = False, str(exc)
                else:
                    if uid is not None:
                        return uid
                    continue
            uid = self._scan(p, peer_port, o, own_port)
            if uid is not None:
                return uid
        return None

    def _readable(self) -> bool:
        return any(_can_read(f"{self.proc_net}/{name}") for name in ("tcp", "tcp6"))

    @staticmethod
    def _ask_kernel(peer: Address, peer_port: int, own: Address, own_port: int) -> int | None:
        family = socket.AF_INET if peer.version == 4 else socket.AF_INET6
        sockid = (struct.pack("!HH", peer_port, own_port) + peer.packed.ljust(16, b"\0") + own.packed.ljust(16, b"\0")
                  + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE))
        body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
        header = struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(header + body)
            answer = nl.recv(8192)
        kind = struct.unpack_from("=H", answer, 4)[0]
        if kind == _NLMSG_ERROR:
            errno_ = -struct.unpack_from("=i", answer, 16)[0]
            if errno_ in (2, 22):  # ENOENT: not a socket of this namespace; EINVAL: no such address family here
                return None
            raise OSError(errno_, "sock_diag")
        if kind != _SOCK_DIAG_BY_FAMILY or len(answer) < _UID_AT + 4:
            return None
        return int(struct.unpack_from("=I", answer, _UID_AT)[0])

    def _scan(self, peer: Address, peer_port: int, own: Address, own_port: int) -> int | None:
        """The uid column of the /proc/net line whose local end is the peer's and remote end is ours."""
        name = "tcp" if peer.version == 4 else "tcp6"
        local, remote = _proc_address(peer, peer_port), _proc_address(own, own_port)
        try:
            with open(f"{self.proc_net}/{name}", encoding="ascii") as lines:
                for line in lines:
                    fields = line.split()
                    if len(fields) > 7 and fields[1] == local and fields[2] == remote:
                        return int(fields[7])
        except (OSError, ValueError):
            pass
        return None


def _proc_address(addr: Address, port: int) -> str:
    """An address and port as /proc/net/tcp writes them: each 32-bit word in host order, in hex."""
    words = struct.unpack(f"={len(addr.packed) // 4}I", addr.packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _can_read(path: str) -> bool:
    try:
        with open(path, encoding="ascii"):
            return True
    except OSError:
        return False
