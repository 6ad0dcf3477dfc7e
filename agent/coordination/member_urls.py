"""A VM's URL from its name and a template (`peer_url`, `budget.wake_url`): the template's fields, the
computer name derived on a Uniform scale set, and the checks a value passes before it goes into a URL (pure).

Shared by the peers backend (how a peer is reached) and the disruption budget (where a wake hint goes); see
`agent.coordination.peers.peer_addressing` for the whole lookup (static map, peers file, template).
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from urllib.parse import quote

from agent.model.identity import Identity

TEMPLATE_FIELDS = ("name", "computer_name", "instance_id")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")
COMPUTER_ID_DIGITS = 6
SCALE_SET_COMPUTER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,56}[0-9A-Za-z]{6}$")
"""A Uniform scale-set computer name: one label, a prefix that starts with a letter (never IP-like), the id."""
_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def base36(n: int) -> str:
    """`n` in base 36, lower case, as Azure writes instance ids into computer names."""
    out = ""
    while True:
        n, digit = divmod(n, 36)
        out = _BASE36[digit] + out
        if n == 0:
            return out


def instance_id(name: str, scale_set: str) -> int | None:
    """The instance id of a Uniform scale-set VM name (`web_3` in scale set `web` → 3), else None."""
    head, sep, tail = name.rpartition("_")
    if not sep or not scale_set or head.casefold() != scale_set.casefold() or not tail.isdigit():
        return None
    return int(tail)


def unusable_computer_name(me: Identity) -> bool:
    """Whether this Uniform scale-set VM's computer name is not of the shape its peers' names are derived from."""
    return instance_id(me.name, me.scale_set) is not None and not SCALE_SET_COMPUTER_NAME.match(me.computer_name)


def computer_name_prefix(me: Identity) -> str | None:
    """The scale set's computerNamePrefix, when this VM's own names prove it (Uniform, default naming)."""
    own = instance_id(me.name, me.scale_set)
    suffix = base36(own).rjust(COMPUTER_ID_DIGITS, "0") if own is not None else ""
    if not suffix or not SCALE_SET_COMPUTER_NAME.match(me.computer_name) \
            or not me.computer_name.lower().endswith(suffix) or len(me.computer_name) == len(suffix):
        return None
    return me.computer_name[:-len(suffix)]


def peer_fields(name: str, me: Identity | None) -> dict[str, str]:
    """Template values for a peer: its name, computer name (derived in this VM's scale set) and instance id."""
    number = instance_id(name, me.scale_set) if me is not None else None
    prefix = computer_name_prefix(me) if me is not None and number is not None else None
    computer = prefix + base36(number).rjust(COMPUTER_ID_DIGITS, "0") if prefix and number is not None else name
    return {"name": name, "computer_name": computer, "instance_id": "" if number is None else str(number)}


def template_fields(template: str) -> list[str]:
    """The fields a `peer_url` template uses; ValueError for a malformed one or an unknown field."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(f"not a URL template: {exc}") from None
    unknown = [f for f in fields if f not in TEMPLATE_FIELDS]
    if unknown or not fields:
        raise ValueError("use {name}, {computer_name} or {instance_id}"
                         + (f", not {{{unknown[0]}}}" if unknown else ""))
    return fields


def from_template(template: str, values: Mapping[str, str]) -> str:
    """The URL a template gives for these values; ValueError when a value is unsafe where it goes."""
    out, in_host = "", True
    for literal, field, _, _ in string.Formatter().parse(template):
        out += literal
        if in_host and "/" in out.partition("://")[2]:
            in_host = False
        if field is None:
            continue
        value = values.get(field, "")
        if in_host and not HOSTNAME.match(value):
            raise ValueError(f"{field} {value!r} is not a host name")
        if not in_host and not value:
            raise ValueError(f"{field} is empty")
        out += value if in_host else quote(value, safe="")
    return out.rstrip("/")


def member_url(template: str, name: str, me: Identity | None) -> str | None:
    """A disruption budget member's base URL from `coordination.budget.wake_url` and its name (as a peer's from
    `peer_url`); None when the name is not safe where the template puts it (no hint is sent then)."""
    try:
        return from_template(template, peer_fields(name, me))
    except ValueError:
        return None
