"""How a peer named in `Resources` is reached: static map, peers file, or the `peer_url` template (pure).

`Resources` names VMs as Azure does, which is not always a host name:

- plain VMs and availability sets: the VM name, which the VNET's DNS resolves;
- Uniform scale sets: `{scale-set}_{instance id}` (`web_3`); the instance's computer name is
  `{computerNamePrefix}{instance id in base 36, 6 digits}` (`web000003`). The prefix is learned from
  this VM's own compute metadata (`osProfile.computerName` minus its own base-36 id), so a peer of
  the same scale set gets `{computer_name}` without anything typed by hand. Only a computer name of
  that shape is used (one host-name label: a prefix starting with a letter, then the base-36 id):
  compute metadata saying `10.0.0.000003` would otherwise send peer requests, and the token, to
  `10.0.0.000005`;
- anything else (Flexible scale sets, other subnets): `coordination.peers_file` or `peers`.

Lookup order: `peers` (config), then the peers file, then the template; the maps may be keyed by
the `Resources` name or by the computer name (what an inventory knows), compared case-insensitively.
Template values are checked before they go into a URL: one in the host part must be a host name
(`web_3` is not, `127.0.0.1:1/steal?x=` is not), one in the path is quoted, so the bearer token
only ever goes to an address the operator configured.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote

from agent.model.identity import Identity

TEMPLATE_FIELDS = ("name", "computer_name", "instance_id")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")
EVENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
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


@dataclass(frozen=True)
class Address:
    """Where a peer is asked, and how that was decided (`via`: peers, peers_file, template)."""

    url: str | None
    via: str
    problem: str = ""


def folded(table: Mapping[str, str]) -> dict[str, str]:
    """A map keyed by case-folded names, as `resolve` looks names up."""
    return {k.casefold(): v for k, v in table.items()}


def resolve(name: str, *, peers: Mapping[str, str], peers_file: Mapping[str, str], template: str,
            me: Identity | None) -> Address:
    """The peer's base URL: `peers`, then the peers file (both `folded`, keyed by Resources or computer name),
    then the template."""
    fields = peer_fields(name, me)
    for via, table in (("peers", peers), ("peers_file", peers_file)):
        url = table.get(name.casefold()) or table.get(fields["computer_name"].casefold())
        if url is not None:
            return Address(url.rstrip("/"), via)
    try:
        return Address(from_template(template, fields), "template")
    except ValueError as exc:
        return Address(None, "template", f"{exc}; list it in coordination.peers_file")


def member_url(template: str, name: str, me: Identity | None) -> str | None:
    """A disruption budget member's base URL from `coordination.budget.wake_url` and its name (as a peer's from
    `peer_url`); None when the name is not safe where the template puts it (no hint is sent then)."""
    try:
        return from_template(template, peer_fields(name, me))
    except ValueError:
        return None


def event_url(base: str, event_id: str, suffix: str = "") -> str:
    """`{base}/v1/events/{EventId}{suffix}`; ValueError for an EventId that is not id-shaped."""
    if not EVENT_ID.match(event_id):
        raise ValueError(f"EventId {event_id[:40]!r} is not id-shaped")
    return f"{base}/v1/events/{quote(event_id, safe='')}{suffix}"
