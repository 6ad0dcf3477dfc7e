"""Who is calling maintd's HTTP server and what they may see and do: the rules, as functions of the
request (its uid on the unix socket, its address, its bearer token) and `server.*`.

- **operator**: this host over TCP (exactly 127.0.0.1 or ::1), a permitted uid on the unix socket
  (`server.unix_socket`: root, the user maintd runs as, and members of `server.unix_socket_group`,
  known by `SO_PEERCRED`), or a bearer token from `server.token_file`. Reads everything. Mutates
  over the unix socket or with the token; a TCP loopback caller without the token mutates only
  when `server.require_token_on_loopback: false` says so (any local user can reach 127.0.0.1).
- **peer**: anyone else who passes `coordination.token_file` (or anyone, when it is not set). Gets
  readiness only: an event's id, status, rank and `ready`, and health states without descriptions
  — what the coordinator and the fleet gate read — never hook output.
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
from typing import NamedTuple

from agent.http.http_connection import is_loopback
from agent.http.http_wire import Request

PEER_EVENT_FIELDS = ("EventId", "EventType", "EventStatus", "NotBefore", "vm_name", "present", "names_self", "rank",
                     "ready")
"""What a peer sees of an event: enough to rank and wait, nothing an operator wrote or a hook printed."""
PEER_HEALTH_FIELDS = ("SourceId", "Property", "HealthState", "IsExpired")


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
    """Who may do what (from `server.*`)."""

    token_reader: Callable[[], str | None] = lambda: None
    require_token_on_loopback: bool = True
    unix_socket: str | None = None
    unix_socket_group: str | None = None
    own_uid: int = dataclasses.field(default_factory=os.geteuid)


class Caller(NamedTuple):
    """One request's caller as the rules see it."""

    operator_read: bool
    may_mutate: bool
    by: str


def identify(request: Request, access: Access) -> Caller:
    """Who is calling: what they may read and change, and how the audit journal names them."""
    if request.uid is not None:
        allowed = socket_caller_ok(request.uid, request.gid or -1, access.unix_socket_group, access.own_uid)
        return Caller(allowed, allowed, f"uid {request.uid} (unix socket)")
    token = token_ok(request.header("authorization"), access.token_reader())
    loopback = is_loopback(request.client)
    by = f"{request.client} (token)" if token else request.client
    return Caller(loopback or token, token or (loopback and not access.require_token_on_loopback), by)


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
