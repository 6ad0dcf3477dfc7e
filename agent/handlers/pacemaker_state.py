"""Pure: the Pacemaker cluster as the `pacemaker` handler reads it, and every decision it makes.

`parse_mon` reads `crm_mon --output-as=xml` (member nodes: online, standby, maintenance; each
resource's role, flags and the nodes it is active on, clone and group members included);
`parse_claims` reads maintd's records in the CIB's `crm_config` section (the cluster-wide lock and
each node's claim, decision 0240). `decide` says whether this node may leave now: it never takes the
last nodes (`min_online` others stay online; standby, offline, maintenance and nodes another maintd
is taking out do not count) and never a cluster all of whose nodes one event names. `moved` says
whether the node is empty and every resource that ran on it runs elsewhere. Nothing here runs a
command; the XML these functions write is all a command line ever carries (node names checked
against `NODE_NAME`, event ids made safe by `safe_event_id`, numbers): never event text.
"""

from __future__ import annotations

import hashlib
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Literal

NODE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""A cluster node name maintd accepts (it becomes part of a CIB id)."""
LOCK_ID = "maintd-lock"
"""The fixed id of the lock: one `cibadmin --create` of it wins, every other fails with 'File exists'."""
CLAIM_PREFIX = "maintd-claim-"
LOCK_TTL = 30.0
"""Seconds a lock is held at most; a holder gone past that is swept (compare-and-delete)."""
CLAIM_MARGIN = 900.0
"""A claim lasts until NotBefore plus the expected impact plus this; extended while the event lasts."""

Action = Literal["take", "resume", "hold", "whole_cluster"]


class ParseError(ValueError):
    """The cluster's answer is not what its tools print."""


@dataclass(frozen=True)
class NodeView:
    name: str
    online: bool
    standby: bool
    maintenance: bool = False


@dataclass(frozen=True)
class ResourceView:
    id: str
    role: str
    nodes: tuple[str, ...]
    """The nodes it is active on."""
    failed: bool = False
    blocked: bool = False
    managed: bool = True
    clone: str | None = None
    """The clone (or bundle) it is an instance of: its instances stop with their node and move nowhere."""


@dataclass(frozen=True)
class ClusterView:
    nodes: dict[str, NodeView]
    resources: tuple[ResourceView, ...] = ()
    dc: str | None = None

    def on(self, node: str) -> tuple[str, ...]:
        """The resources active on `node`, each named once."""
        return tuple(dict.fromkeys(r.id for r in self.resources if node in r.nodes))

    def running(self, rsc: str, besides: str) -> tuple[str, ...]:
        """The nodes other than `besides` where `rsc` (or any instance of it) is active."""
        return tuple(dict.fromkeys(n for r in self.resources if r.id == rsc for n in r.nodes if n != besides))


@dataclass(frozen=True)
class Claim:
    """One node taken out by a maintd for an event, until `expires` (seconds since the epoch)."""

    node: str
    event: str
    expires: float


@dataclass(frozen=True)
class Lock:
    holder: str
    token: str
    expires: float

    @property
    def value(self) -> str:
        return f"{self.holder} {self.token} {self.expires:.0f}"


@dataclass(frozen=True)
class Claims:
    lock: Lock | None = None
    by_node: dict[str, Claim] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str
    online: tuple[str, ...] = ()
    """The other nodes that count as online."""


def _flag(el: ET.Element, name: str) -> bool:
    return el.get(name) == "true"


def parse_mon(text: str) -> ClusterView:
    """`crm_mon -1 --output-as=xml` as a `ClusterView`; ParseError when it is not crm_mon's XML."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ParseError(f"crm_mon printed no XML ({exc})") from None
    nodes_el = root.find("nodes")
    if nodes_el is None:
        raise ParseError("crm_mon's XML has no <nodes>")
    nodes = {}
    for n in nodes_el.iter("node"):
        name = n.get("name")
        if name and n.get("type", "member") == "member":
            nodes[name] = NodeView(name, _flag(n, "online"), _flag(n, "standby") or _flag(n, "standby_onfail"),
                                   _flag(n, "maintenance"))
    resources: list[ResourceView] = []
    res_el = root.find("resources")
    if res_el is not None:
        _resources(res_el, None, resources)
    dc_el = root.find("summary/current_dc")
    dc = dc_el.get("name") if dc_el is not None and dc_el.get("present") == "true" else None
    return ClusterView(nodes, tuple(resources), dc)


def _resources(parent: ET.Element, clone: str | None, out: list[ResourceView]) -> None:
    for el in parent:
        if el.tag == "resource":
            on = tuple(n.get("name", "") for n in el.findall("node")) if _flag(el, "active") else ()
            out.append(ResourceView(el.get("id", ""), el.get("role", ""), tuple(n for n in on if n),
                                    _flag(el, "failed"), _flag(el, "blocked"), el.get("managed") != "false", clone))
        elif el.tag in ("clone", "bundle"):
            _resources(el, el.get("id", ""), out)
        elif el.tag == "group" or el.tag == "replica":
            _resources(el, clone, out)


def safe_event_id(event_id: str) -> str:
    """The event's id as it may appear in the CIB and on a command line (letters, digits and -), else a hash."""
    if re.fullmatch(r"[A-Za-z0-9-]{1,64}", event_id):
        return event_id
    return "sha256-" + hashlib.sha256(event_id.encode()).hexdigest()[:32]


def claim_id(node: str) -> str:
    return CLAIM_PREFIX + node


def parse_claims(text: str) -> Claims:
    """maintd's lock and claims in `cibadmin --query --scope crm_config`; malformed records are ignored
    (a claim that cannot be read cannot hold a node out)."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ParseError(f"cibadmin printed no XML ({exc})") from None
    lock, claims = None, {}
    for ps in root.iter("cluster_property_set"):
        sid = ps.get("id", "")
        pair = ps.find("nvpair")
        value = pair.get("value", "") if pair is not None else ""
        parts = value.split()
        if sid == LOCK_ID and len(parts) == 3 and _number(parts[2]) is not None:
            lock = Lock(parts[0], parts[1], float(parts[2]))
        elif sid.startswith(CLAIM_PREFIX) and len(parts) == 2 and _number(parts[1]) is not None:
            node = sid[len(CLAIM_PREFIX):]
            if re.fullmatch(NODE_NAME, node):  # it may reach a command line (a lapsed claim's standby cleared)
                claims[node] = Claim(node, parts[0], float(parts[1]))
    return Claims(lock, claims)


def _number(s: str) -> float | None:
    try:
        return float(s) if re.fullmatch(r"[0-9]{1,12}(\.[0-9]+)?", s) else None
    except ValueError:
        return None


def lock_xml(lock: Lock) -> str:
    return (f'<cluster_property_set id="{LOCK_ID}"><nvpair id="{LOCK_ID}-holder" name="{LOCK_ID}-holder" '
            f'value="{lock.value}"/></cluster_property_set>')


def _set_xpath(set_id: str, pair_id: str, value: str) -> str:
    return f"//cluster_property_set[@id='{set_id}'][nvpair[@id='{pair_id}' and @value='{value}']]"


def lock_xpath(lock: Lock) -> str:
    """What deletes this very lock and no later one (the whole set, only while it holds this value: one CIB
    operation; deleting the nvpair alone would leave an empty set that no `--create` could get past)."""
    return _set_xpath(LOCK_ID, f"{LOCK_ID}-holder", lock.value)


def claim_xpath(claim: Claim) -> str:
    """What deletes this claim and not one renewed or remade since."""
    cid = claim_id(claim.node)
    return _set_xpath(cid, f"{cid}-event", f"{claim.event} {claim.expires:.0f}")


def claim_xml(claim: Claim) -> str:
    cid = claim_id(claim.node)
    return (f'<cluster_property_set id="{cid}"><nvpair id="{cid}-event" name="{cid}-event" '
            f'value="{claim.event} {claim.expires:.0f}"/></cluster_property_set>')


def claim_expiry(not_before: float | None, now: float, impact: float) -> float:
    """When a claim made now lapses if no maintd renews it: after the maintenance is expected to end."""
    return max(not_before or now, now) + impact + CLAIM_MARGIN


def live(claim: Claim | None, now: float) -> bool:
    return claim is not None and claim.expires > now


def named(view: ClusterView, resources: tuple[str, ...]) -> tuple[str, ...]:
    """The cluster's nodes an event names (case-insensitively: node names taken to be the VMs' names)."""
    names = {r.casefold() for r in resources}
    return tuple(n for n in view.nodes if n.casefold() in names)


def decide(view: ClusterView, claims: Claims, me: str, event: str, resources: tuple[str, ...],
           min_online: int, now: float) -> Verdict:
    """Whether this node may leave for the event now (under the lock): take, resume (it already did),
    hold (min_online would break) or whole_cluster (the event names every node: an error)."""
    mine = claims.by_node.get(me)
    if live(mine, now) and mine is not None and mine.event == event:
        return Verdict("resume", f"{me} is already out for this event")
    if me not in view.nodes:
        return Verdict("hold", f"{me} is not a node of this cluster (nodes: {', '.join(sorted(view.nodes)) or '-'})")
    hit = named(view, resources)
    if len(view.nodes) > 1 and set(hit) | {me} == set(view.nodes):
        return Verdict("whole_cluster", f"this event takes the whole cluster down: it names every node "
                       f"({', '.join(sorted(set(hit) | {me}))})")
    online, out = [], []
    for n in sorted(view.nodes):
        if n == me:
            continue
        v, c = view.nodes[n], claims.by_node.get(n)
        why = ("offline" if not v.online else "in standby" if v.standby else "in maintenance mode" if v.maintenance
               else f"being taken out by maintd for event {c.event}" if live(c, now) and c is not None else "")
        (out.append(f"{n} {why}") if why else online.append(n))
    if len(online) < min_online:
        detail = "; ".join(out) if out else "no other node"
        return Verdict("hold", f"taking {me} out would leave {len(online)} other node(s) online, fewer than "
                       f"min_online {min_online} ({detail})", tuple(online))
    return Verdict("take", f"{len(online)} other node(s) stay online ({', '.join(online) or '-'})", tuple(online))


@dataclass(frozen=True)
class MoveState:
    done: bool
    on_node: tuple[str, ...]
    """Resources still active on the node."""
    stuck: tuple[str, ...]
    """Resources that ran on the node and run nowhere else now (a clone's instances excepted)."""
    failed: tuple[str, ...]
    """Resources on the node whose stop failed or that are blocked or unmanaged."""


def moved(view: ClusterView, me: str, before: tuple[str, ...]) -> MoveState:
    """Whether every resource left `me`: none active on it, each one that ran there (`before`) active
    elsewhere (a clone's instance stops with its node and needs nothing; with no other node able to run
    resources, min_online 0 let the last node go, and stopped is all a resource can be)."""
    on = view.on(me)
    clones = {r.id for r in view.resources if r.clone is not None}
    elsewhere = any(v.online and not v.standby and not v.maintenance for n, v in view.nodes.items() if n != me)
    stuck = tuple(r for r in before if elsewhere and r not in clones and r not in on and not view.running(r, me))
    failed = tuple(dict.fromkeys(r.id for r in view.resources if me in r.nodes
                                 and (r.failed or r.blocked or not r.managed)))
    return MoveState(not on and not stuck, on, stuck, failed)


def summary(view: ClusterView, me: str) -> str:
    """This node's cluster state in one line, for health and `maintd status`."""
    node = view.nodes.get(me)
    if node is None:
        return f"{me}: not a member node of the cluster"
    state = ("online" if node.online else "offline") + (", in standby" if node.standby else "") + \
        (", in maintenance mode" if node.maintenance else "")
    on = view.on(me)
    others = [n for n, v in sorted(view.nodes.items()) if n != me and v.online and not v.standby]
    return (f"{me}: {state}; resources here: {', '.join(on) if on else 'none'}; "
            f"other nodes online: {', '.join(others) if others else 'none'}")
