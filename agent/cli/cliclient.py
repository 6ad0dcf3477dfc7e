"""The CLI's client side: the commands that talk to a running daemon (over its unix socket, else TCP to
`server.listen`), and `events --history` from the audit journal.

Kept apart from `agent.cli.commands`, which imports it only to run one of `COMMANDS`: `maintd run` never
loads it. The token never reaches a listener the CLI has not authenticated: over TCP it goes to
`server.listen` (any address of this host: 127.0.0.0/8, an interface's, a wildcard's loopback) only when
the kernel says root or maintd's user holds the listening end, or to the address the user named with `--url`.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import socket
import struct
import sys
import urllib.parse
from collections.abc import Callable
from typing import Any

from agent.cli import cliviews
from agent.config import config as config_mod
from agent.errors import ConfigError
from agent.model.timefmt import iso_z


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where and how the CLI reaches the daemon: its unix socket first when there is one, else TCP; the token
    is read only when a TCP listener is to get it (`asked`: the user named it with --url)."""

    url: str
    unix_socket: str | None = None
    token_file: str | None = None
    asked: bool = False

    def token(self) -> str | None:
        """$MAINTD_TOKEN, else the contents of server.token_file when this user can read it."""
        return os.environ.get("MAINTD_TOKEN") or _read_token(self.token_file)


def _target(args: argparse.Namespace) -> _Target:
    """--url as given (TCP only); else from the config: its unix socket, with TCP to `server.listen` behind it
    (127.0.0.1 for a wildcard).

    The token goes over TCP only (on the socket the caller's uid decides): to --url, or to a listener the kernel
    says maintd's own user holds (`_listener_problem`).
    """
    try:
        server = config_mod.load(config_mod.path_from(args.config), check_perms=False).server
    except ConfigError as exc:
        server = _server_despite(exc, args)
    if args.url:
        return _Target(args.url.rstrip("/"), token_file=server.token_file, asked=True)
    host, _, port = server.listen.rpartition(":")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return _Target(f"http://{host}:{port}", server.unix_socket, server.token_file)


def _server_despite(exc: ConfigError, args: argparse.Namespace) -> config_mod.ServerConfig:
    """The default addresses when there is no config to read here (none installed, or not this user's to read);
    a config maintd refuses (or one named by --config or $MAINTD_CONFIG that cannot be read) ends the command
    with status 1 saying why, unless --url says where the daemon is."""
    chosen = bool(args.config or os.environ.get("MAINTD_CONFIG"))
    if not chosen and not os.access(exc.path, os.R_OK):
        return config_mod.ServerConfig(listen="127.0.0.1:8088")
    if args.url:
        print(f"maintd: config refused: {exc}; asking {args.url} without it", file=sys.stderr)
        return config_mod.ServerConfig(listen="127.0.0.1:8088")
    raise SystemExit(f"maintd: config refused: {exc}\nmaintd: fix it (`maintd check-config {exc.path}` checks it), "
                     "or pass --url to ask the daemon at a given address")


def _read_token(path: str | None) -> str | None:
    """The token in `path` when this user may read it (root may), else None."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


class _UnixConnection(http.client.HTTPConnection):
    """http.client over a unix socket (the daemon's `server.unix_socket`)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


@dataclasses.dataclass(frozen=True)
class _Answer:
    """The daemon's answer, and why the unix socket was passed over for TCP (None: it was used, or there is none)."""

    status: int
    text: str
    fallback: str | None = None


class _Stranger(Exception):
    """The TCP listener is not maintd's: it was sent nothing (a message for the operator)."""


def _listener_problem(sock: socket.socket) -> str | None:
    """Why the listener at the other end of `sock` may not be sent anything (None: the kernel says root's, maintd's
    user's or this user's process holds it): `SO_PEERCRED` on the unix socket, the owner of the accepting TCP
    socket at whatever address of this host the daemon listens. One the kernel cannot name is not vouched for."""
    from agent.http.peer_owner import PeerOwners
    from agent.trust.pathtrust import owner, trusted_uids

    problem = ""
    if sock.family == socket.AF_UNIX:
        uid: int | None = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        where = str(sock.getpeername())
    else:
        uid, problem = PeerOwners().listener(sock)
        host, port = sock.getpeername()[:2]
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if uid in trusted_uids():
        return None
    if uid is None:
        return (f"{where} is served by a process the kernel does not name ({problem}): the CLI sent it neither the "
                "token nor the request, since it cannot tell it is maintd")
    return (f"{where} is served by {owner(uid)}, not by maintd (root or maintd's user): the CLI sent it neither the "
            "token nor the request")


def _tcp(target: _Target, method: str, path: str, data: bytes | None, headers: dict[str, str],
         fallback: str | None) -> _Answer:
    """One request over TCP; the token only to --url or to a listener maintd's user holds (else `_Stranger`)."""
    url = urllib.parse.urlsplit(target.url)
    kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = kind(url.hostname or "127.0.0.1", url.port, timeout=10)
    try:
        conn.connect()
        assert conn.sock is not None
        problem = None if target.asked else _listener_problem(conn.sock)
        if problem:
            raise _Stranger("; ".join(filter(None, (fallback, problem))))
        token = target.token()
        if token:
            headers = {**headers, "Authorization": f"Bearer {token}"}
        conn.request(method, url.path.rstrip("/") + path, body=data, headers=headers)
        answer = conn.getresponse()
        return _Answer(answer.status, answer.read().decode("utf-8", "replace"), fallback)
    finally:
        conn.close()


def _send(target: _Target, method: str, path: str, body: Any) -> _Answer:
    """One request to the daemon: over the unix socket when it can be connected to, else TCP; raises OSError when
    the daemon is unreachable, `_Stranger` when what listens on its socket or TCP port is not maintd."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    fallback = None
    if target.unix_socket:
        conn = _UnixConnection(target.unix_socket, timeout=10)
        try:
            conn.connect()  # only a failure to connect falls back: a request once sent is never sent twice
        except OSError as exc:
            conn.close()
            fallback = (f"the CLI could not use the unix socket {target.unix_socket} "
                        f"({exc.strerror or type(exc).__name__}) and asked {target.url} instead")
        else:
            try:
                assert conn.sock is not None
                problem = _listener_problem(conn.sock)
                if problem:
                    raise _Stranger(problem)
                conn.request(method, path, body=data, headers=headers)
                answer = conn.getresponse()
                return _Answer(answer.status, answer.read().decode("utf-8", "replace"))
            finally:
                conn.close()
    try:
        return _tcp(target, method, path, data, headers, fallback)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        if fallback:
            exc.add_note(fallback)  # why the unix socket was passed over, for the message
        raise


_DONE = {"/v1/drain": "drained", "/v1/undrain": "undrained", "/approve": "manual_approval"}
"""What a change's answer says when maintd made it (by the end of its path): a 200 without it changed nothing."""


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    """The daemon's JSON answer; a failure to reach it, a non-200 answer or a change's answer that does not say it
    was made ends the command with status 1 and says why (and, when the unix socket could not be used, why not
    and what to do)."""
    target = _target(args)
    try:
        sent = _send(target, method, path, body)
    except _Stranger as exc:
        raise SystemExit(f"maintd: {exc}. Is maintd running? (systemctl status maintd; sudo maintd ... uses the "
                         "unix socket; --url sends the token to the address you name)") from None
    except (OSError, ValueError, http.client.HTTPException) as exc:
        where = " or ".join(filter(None, (target.unix_socket, target.url + path)))
        why = "".join(f"\nmaintd: {note}" for note in getattr(exc, "__notes__", ()))
        raise SystemExit(f"maintd: cannot reach the daemon at {where} ({type(exc).__name__}); is it running? "
                         f"(systemctl status maintd; or pass --url){why}") from None
    try:
        answer = json.loads(sent.text)
    except ValueError:
        answer = sent.text
    if sent.status != 200:
        message = answer.get("error") if isinstance(answer, dict) else answer
        why = f"\nmaintd: {sent.fallback}" if sent.fallback and sent.status in (401, 403) else ""
        raise SystemExit(f"maintd: the daemon answered {sent.status}: {message}{why}")
    done = next((key for end, key in _DONE.items() if method == "POST" and path.endswith(end)), None)
    if done and not (isinstance(answer, dict) and done in answer):
        raise SystemExit(f"maintd: the answer does not say the change was made (no {done!r} in {sent.text[:200]!r}): "
                         "nothing is known to have changed; check with maintd status")
    return answer


def _print_json(body: Any) -> int:
    print(json.dumps(body, indent=2))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    body = _call(args, "GET", "/v1/status")
    if args.json:
        return _print_json(body)
    print(cliviews.status_text(body))
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    if args.history:
        return _history(args)
    if args.since or args.type:
        raise SystemExit("maintd: --since and --type choose entries of the audit journal: add --history")
    event_id = args.event or args.event_id
    body = _call(args, "GET", f"/v1/events/{event_id}" if event_id else "/v1/events")
    if args.json:
        return _print_json(body)
    print(cliviews.event_text(body) if event_id else cliviews.events_text(body))
    return 0


def _history(args: argparse.Namespace) -> int:
    """`events --history`: the audit journal, read from the state directory (the daemon may be down)."""
    from agent.state.journal import read_journal

    try:
        cfg = config_mod.load(config_mod.path_from(args.config), check_perms=False)
        directory = config_mod.with_state_env(cfg).state.dir
    except ConfigError as exc:
        print(f"maintd: {exc}", file=sys.stderr)
        return 1
    entries = cliviews.select_history(list(read_journal(directory)), args.since, args.type,
                                      args.event or args.event_id)
    if args.json:
        for entry in entries:
            print(json.dumps(entry))
        return 0
    print(cliviews.history_text(entries))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    body = _call(args, "POST", "/v1/drain", {"reason": args.reason})
    print(f"out of rotation: {args.reason}" + (" (was already drained)" if body.get("already") else ""))
    if body.get("note"):
        print(body["note"])
    return 0


def cmd_undrain(args: argparse.Namespace) -> int:
    body = _call(args, "POST", "/v1/undrain")
    remaining = body.get("remaining_drains") or {}
    print("manual drain lifted" if body.get("undrained") else "there was no manual drain")
    if remaining:
        print("still out of rotation for: " + ", ".join(remaining))
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    body = _call(args, "POST", f"/v1/events/{args.event_id}/approve")
    print(f"manual approval of {body.get('event_id', args.event_id)} recorded; "
          f"`maintd events {args.event_id}` shows when it is sent")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    body = _call(args, "GET", "/v1/health")
    if args.json:
        return _print_json(body)
    print(cliviews.health_text(body))
    return 0 if body.get("AggregatedHealthState") != "Error" else 2


def cmd_fleet(args: argparse.Namespace) -> int:
    if getattr(args, "history", False):
        since = getattr(args, "since", None)
        body = _call(args, "GET", "/v1/fleet/history" + (f"?since={urllib.parse.quote(iso_z(since))}" if since else ""))
        if args.json:
            return _print_json(body)
        print(cliviews.fleet_history_text(body))
        return 0
    body = _call(args, "GET", "/v1/fleet")
    if args.json:
        return _print_json(body)
    print(cliviews.fleet_text(body))
    return 0


def watch_answers(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """What `maintd watch` shows, asked anew each second: the status, the events, the fleet."""
    return _call(args, "GET", "/v1/status"), _call(args, "GET", "/v1/events"), _call(args, "GET", "/v1/fleet")


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "status": cmd_status, "events": cmd_events, "fleet": cmd_fleet, "drain": cmd_drain, "undrain": cmd_undrain,
    "approve": cmd_approve, "health": cmd_health}
"""The CLI's commands run here, by name."""
