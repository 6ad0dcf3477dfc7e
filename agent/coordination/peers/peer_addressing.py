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
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote

from agent.coordination.member_urls import from_template, peer_fields
from agent.model.identity import Identity

EVENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


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


def event_url(base: str, event_id: str, suffix: str = "") -> str:
    """`{base}/v1/events/{EventId}{suffix}`; ValueError for an EventId that is not id-shaped."""
    if not EVENT_ID.match(event_id):
        raise ValueError(f"EventId {event_id[:40]!r} is not id-shaped")
    return f"{base}/v1/events/{quote(event_id, safe='')}{suffix}"
