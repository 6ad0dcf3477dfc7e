"""Who is calling maintd's HTTP server and what they may see and do: one table (`TABLE`, endpoint kind x
caller x token) that every route is answered from, and the rules that place a request in it.

- **caller** (`Source`): a permitted uid on the unix socket (`server.unix_socket`: root, the user maintd
  runs as, and members of `server.unix_socket_group`, known by `SO_PEERCRED`), another uid there, this
  host over TCP (exactly 127.0.0.1 or ::1; any local user can reach it), and any other address.
  `server.require_token_on_loopback: false` makes loopback a caller of its own that may act.
- **token** (`Token`): what the request's `Authorization: Bearer` carries: nothing, the peers' shared
  token (`coordination.token_file`), the operator token (`server.token_file`), or another one. On the
  unix socket the uid decides and a token changes nothing.
- **verdict**: answered in full, the peer view (readiness only: an event's id, status, rank and
  `ready`, health states without descriptions — what the coordinator and the fleet gate read, never
  hook output), 401 or 403. A cell may depend on whether `coordination.token_file` is set: without it
  every TCP caller passes the peers' check.

The README prints the same table (`markdown`, kept equal by `agent.cli.docgen` and its test).
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd

# hmac.compare_digest is this function, but importing hmac maps OpenSSL's libcrypto (3.5 MB resident for the
# life of the process: decision 0220); the same constant-time comparison, without it
from _operator import _compare_digest as compare_digest
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from agent.http.http_connection import is_loopback
from agent.http.http_wire import Request

PEER_EVENT_FIELDS = ("EventId", "EventType", "EventStatus", "NotBefore", "vm_name", "present", "names_self", "rank",
                     "ready")
"""What a peer sees of an event: enough to rank and wait, nothing an operator wrote or a hook printed."""
PEER_HEALTH_FIELDS = ("SourceId", "Property", "HealthState", "IsExpired")


class Kind(Enum):
    """What an endpoint does, as the table tells them apart (each route has one)."""

    OPEN = "open to all"
    READ = "operator reads"
    SHARED = "reads a peer may make"
    CHANGE = "changes"
    HINT = "hints between peers"


class Source(Enum):
    """Where a request comes from."""

    SOCKET = "unix socket, permitted uid"
    SOCKET_OTHER = "unix socket, any other uid"
    LOOPBACK = "127.0.0.1 or ::1"
    LOOPBACK_TRUSTED = "127.0.0.1 or ::1, require_token_on_loopback: false"
    ELSEWHERE = "any other address"


class Token(Enum):
    """What the request's bearer token is."""

    NONE = "no token"
    PEER = "coordination.token_file's"
    SERVER = "server.token_file's"
    OTHER = "another token"


class Verdict(Enum):
    """How a request is answered."""

    FULL = "yes"
    PEER = "peer view"
    UNAUTHORIZED = "401"
    FORBIDDEN = "403"


@dataclass(frozen=True)
class Cell:
    """The verdict with `coordination.token_file` set, and without it (every TCP caller passes the peers' check)."""

    peers_guarded: Verdict
    peers_open: Verdict

    def text(self) -> str:
        if self.peers_guarded == self.peers_open:
            return self.peers_guarded.value
        return f"{self.peers_guarded.value} ({self.peers_open.value} without coordination.token_file)"


_Y, _P, _401, _403 = Verdict.FULL, Verdict.PEER, Verdict.UNAUTHORIZED, Verdict.FORBIDDEN


def _row(*cells: Verdict | tuple[Verdict, Verdict]) -> dict[Token, Cell]:
    """One caller's cells in `Token` order; a pair is (with coordination.token_file, without)."""
    return {token: Cell(*c) if isinstance(c, tuple) else Cell(c, c) for token, c in zip(Token, cells, strict=True)}


_SOCKETS = {Source.SOCKET: _row(_Y, _Y, _Y, _Y), Source.SOCKET_OTHER: _row(_403, _403, _403, _403)}
_TRUSTED = _row(_Y, _Y, _Y, _Y)
TABLE: Mapping[Kind, Mapping[Source, Mapping[Token, Cell]]] = {
    Kind.OPEN: {source: _row(_Y, _Y, _Y, _Y) for source in Source},
    Kind.READ: {**_SOCKETS, Source.LOOPBACK: _row(_Y, _Y, _Y, _Y), Source.LOOPBACK_TRUSTED: _TRUSTED,
                Source.ELSEWHERE: _row((_401, _403), _403, _Y, (_401, _403))},
    Kind.SHARED: {**_SOCKETS, Source.LOOPBACK: _row(_Y, _Y, _Y, _Y), Source.LOOPBACK_TRUSTED: _TRUSTED,
                  Source.ELSEWHERE: _row((_401, _P), _P, _Y, (_401, _P))},
    Kind.CHANGE: {**_SOCKETS, Source.LOOPBACK: _row(_401, _403, _Y, _403), Source.LOOPBACK_TRUSTED: _TRUSTED,
                  Source.ELSEWHERE: _row(_401, _403, _Y, _403)},
    Kind.HINT: {**_SOCKETS, Source.LOOPBACK: _row((_401, _Y), _Y, _Y, (_401, _Y)), Source.LOOPBACK_TRUSTED: _TRUSTED,
                Source.ELSEWHERE: _row((_401, _Y), _Y, _Y, (_401, _Y))},
}
"""Every answer about who may call what: kind x caller x token. A token sent over the unix socket changes nothing;
a peer's token never makes a change; the operator token does everything from anywhere."""


def token_ok(authorization: str | None, token: str | None) -> bool:
    """Whether `Authorization: Bearer <token>` carries the configured token (constant-time compare)."""
    if not token or not authorization:
        return False
    scheme, _, value = authorization.partition(" ")
    return scheme.lower() == "bearer" and compare_digest(value.strip().encode(), token.encode())


def peer_event_view(view: Mapping[str, object]) -> dict[str, object]:
    """The readiness-only view of an event that a peer gets."""
    return {k: view[k] for k in PEER_EVENT_FIELDS if k in view}


def peer_health_view(health: Mapping[str, object]) -> dict[str, object]:
    """Health as a peer's fleet gate needs it: states per (SourceId, Property), no descriptions."""
    reports = health.get("HealthEvents")
    return {"AggregatedHealthState": health.get("AggregatedHealthState"),
            "HealthEvents": [{k: r.get(k) for k in PEER_HEALTH_FIELDS} for r in reports if isinstance(r, dict)]
            if isinstance(reports, list) else []}


def socket_caller_ok(uid: int, gid: int, group: str | None, own_uid: int) -> bool:
    """Whether a unix-socket caller may act: root, maintd's own user (who could signal or trace it anyway), or a
    member of `group` (primary or supplementary)."""
    if uid in (0, own_uid):
        return True
    if not group:
        return False
    try:
        entry = grp.getgrnam(group)
        return gid == entry.gr_gid or pwd.getpwuid(uid).pw_name in entry.gr_mem
    except KeyError:
        return False


@dataclass(frozen=True)
class Access:
    """What the table's rules read of `server.*` (the peers' token is the daemon's: `identify`'s `peer_authorized`)."""

    token_reader: Callable[[], str | None] = lambda: None
    require_token_on_loopback: bool = True
    unix_socket: str | None = None
    unix_socket_group: str | None = None
    own_uid: int = dataclasses.field(default_factory=os.geteuid)


class Caller(NamedTuple):
    """One request's place in the table, and how the audit journal names it."""

    source: Source
    token: Token
    peers_open: bool
    by: str


def identify(request: Request, access: Access, peer_authorized: Callable[[str | None], bool]) -> Caller:
    """Where the request comes from, what token it carries, and whether the peers' check is open to all."""
    authorization = request.header("authorization")
    peers_open = peer_authorized(None)
    if request.uid is not None:
        allowed = socket_caller_ok(request.uid, request.gid or -1, access.unix_socket_group, access.own_uid)
        return Caller(Source.SOCKET if allowed else Source.SOCKET_OTHER, Token.NONE, peers_open,
                      f"uid {request.uid} (unix socket)")
    if token_ok(authorization, access.token_reader()):
        token = Token.SERVER
    elif not authorization:
        token = Token.NONE
    elif not peers_open and peer_authorized(authorization):
        token = Token.PEER
    else:
        token = Token.OTHER
    if not is_loopback(request.client):
        source = Source.ELSEWHERE
    else:
        source = Source.LOOPBACK if access.require_token_on_loopback else Source.LOOPBACK_TRUSTED
    return Caller(source, token, peers_open, f"{request.client} (token)" if token == Token.SERVER else request.client)


def verdict(kind: Kind, caller: Caller) -> Verdict:
    """The table's answer for this caller at an endpoint of `kind`."""
    cell = TABLE[kind][caller.source][caller.token]
    return cell.peers_open if caller.peers_open else cell.peers_guarded


def refusal(kind: Kind, caller: Caller, refused: Verdict, uid: int | None, unix_socket: str | None) -> str:
    """What a 401 or 403 says: why, and the way forward."""
    if caller.source == Source.SOCKET_OTHER:
        return f"uid {uid} is neither root nor maintd's user nor in server.unix_socket_group"
    if kind == Kind.CHANGE:
        if refused == Verdict.FORBIDDEN:
            return "the bearer token is not the one in server.token_file"
        return how_to_act(unix_socket, caller.source != Source.ELSEWHERE)
    if refused == Verdict.FORBIDDEN:
        return "operator data: ask from this host or with the bearer token in server.token_file"
    where = " (from this host too: server.require_token_on_loopback)" if caller.source == Source.LOOPBACK else ""
    return f"this endpoint needs the bearer token in coordination.token_file{where}"


def how_to_act(unix_socket: str | None, loopback: bool) -> str:
    """The 401 of a mutating endpoint: what the caller can do instead (the socket only helps on this host)."""
    token = "send the bearer token in server.token_file (Authorization: Bearer <token>)"
    if not loopback:
        return f"changes need a bearer token: {token}"
    socket_way = (f"use the unix socket {unix_socket} as root (sudo maintd drain|undrain|approve, or "
                  f"curl --unix-socket {unix_socket} -X POST http://localhost/v1/...), or " if unix_socket else "")
    return (f"loopback alone cannot make changes: {socket_way}{token}; "
            "server.require_token_on_loopback: false lets every local user act (see the README's upgrade notes)")


def peer_authorized(authorization: str | None, token: str | None) -> bool:
    """Whether a peer's request passes `coordination.token_file`: anyone when no token is set."""
    return token is None or token_ok(authorization, token)


def markdown(endpoints: Mapping[Kind, list[str]]) -> str:
    """`TABLE` as the README prints it: one line per kind of endpoint and caller, a column per token."""
    out = ["| endpoints | caller | " + " | ".join(t.value for t in Token) + " |",
           "| --- | --- |" + " --- |" * len(Token)]
    for kind, rows in TABLE.items():
        named = f"{kind.value}: " + ", ".join(f"`{e}`" for e in endpoints.get(kind, []))
        if kind == Kind.OPEN:
            out.append(f"| {named} | anyone | " + " | ".join(c.text() for c in rows[Source.ELSEWHERE].values()) + " |")
            continue
        for source, cells in rows.items():
            out.append(f"| {named} | {source.value} | " + " | ".join(c.text() for c in cells.values()) + " |")
            named = ""
    return "\n".join(out) + "\n"
