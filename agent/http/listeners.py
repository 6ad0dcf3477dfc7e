"""The server's listening sockets: TCP on `server.listen`, and the unix socket whose callers are known by uid.

The unix socket is how root acts on this host without a token, so who can reach it and who can
replace it matter: it is created with mode 0660 (owner maintd's user, group `server.unix_socket_group`
or maintd's own), in a directory nobody else may write to, and it never replaces a file that is not
a socket nor a socket another process still serves (a second maintd must not steal the first's).
"""

from __future__ import annotations

import errno
import os
import socket
import stat

__all__ = ["listen_tcp", "listen_unix"]


def listen_tcp(host: str, port: int, backlog: int = socket.SOMAXCONN) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when host has a colon), with the longest accept queue the kernel
    allows (net.core.somaxconn): while a flood opens thousands of connections, the LB's SYN is queued, not dropped
    and retransmitted a second later."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def listen_unix(path: str, gid: int | None, backlog: int = 64) -> socket.socket:
    """A listening unix socket at `path`, mode 0660 (group `gid` when given); OSError naming the path and the
    way out when it cannot be made safely."""
    try:
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o755, exist_ok=True)
        _check_directory(directory)
        _remove_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)  # nobody can connect before listen(): the mode is set first, the umask left alone
        os.chmod(path, 0o660)  # (a umask changed here would be every thread's: a state file written meanwhile)
        if gid is not None:
            os.chown(path, -1, gid)
        sock.listen(backlog)
        return sock
    except OSError as exc:
        raise OSError(exc.errno, f"server.unix_socket {path}: {exc.strerror or exc}; run maintd as root under "
                                 "systemd (RuntimeDirectory=maintd makes /run/maintd), or set server.unix_socket "
                                 "to a path in a directory only maintd's user can write, or to null") from None


def _check_directory(directory: str) -> None:
    """Refuse a directory someone else could swap the socket in: owned by another user, or group/world-writable."""
    info = os.stat(directory)
    if info.st_uid not in (0, os.geteuid()) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(errno.EPERM, f"{directory} is writable by others (uid {info.st_uid}, mode "
                                   f"{stat.S_IMODE(info.st_mode):04o}); it must be maintd's or root's, mode 0755 or "
                                   "stricter")


def _remove_stale(path: str) -> None:
    """Remove a socket nobody serves; refuse any other file (a path pointed at /etc/passwd is not unlinked)
    and a live socket."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(errno.EEXIST, "it exists and is not a socket")
    except FileNotFoundError:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:  # what a socket left by a process that is gone answers
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "another process serves it (is maintd already running?)")
