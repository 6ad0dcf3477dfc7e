"""Coordination through a blob store, pure: the blob layout, the records, their parsing, the decisions.

Layout, in the configured container (one folder per event, written only by the VMs it names):

    events/{event-id}/vm/{vm-name}    a VM's marker, written by that VM only (unconditional put):
                                      {maintd: 1, kind: vm, event, vm, state: preparing | ready,
                                       health: ok | unhealthy}
    events/{event-id}/approval        the approval record; created with If-None-Match: * (the claim),
                                      rewritten only with If-Match: <its ETag>:
                                      {maintd: 1, kind: approval, event, by, state, attempt}
                                      state: claimed | approved | released

Every record is blob metadata over an empty body, so one List Blobs (prefix = the event's folder,
include = metadata) returns all of an event: each marker, the approval record with its ETag and
Last-Modified, and the store's own clock (the answer's Date header). Ages are the store's Date
minus a blob's Last-Modified: no VM ever compares its clock with another's.

Anything the protocol did not write — another VM's name in a marker, an unknown or missing field,
an unknown state, a blob name outside the layout — is a problem, reported and never counted: a VM
with an unreadable marker is not ready, and an unreadable approval record is a claim by nobody,
which can be taken over once it is `takeover_after` old (it is never an approval).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agent.coordination.coordination_rules import OK, UNHEALTHY, UNREACHABLE
from agent.errors import MaintdError
from agent.model.timefmt import aware_or_none

VERSION = "1"
PREPARING, READY = "preparing", "ready"
CLAIMED, APPROVED, RELEASED, UNREADABLE = "claimed", "approved", "released", "unreadable"
MARKER_FIELDS = frozenset({"maintd", "kind", "event", "vm", "state", "health"})
APPROVAL_FIELDS = frozenset({"maintd", "kind", "event", "by", "state", "attempt"})
MAX_ATTEMPT = 1_000_000
EVENT_ID = re.compile(r"^[A-Za-z0-9-]{1,128}$")
"""Event ids maintd stores: IMDS gives GUIDs; anything else is refused rather than escaped."""
VM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
"""VM names maintd stores: Azure's VM names (letters, digits, `_`, `-`, `.`), as in Resources."""

RECHECK_FIRST = 2.0
"""Fewest seconds before a VM first lists an event again after its own list (then doubling)."""
FLEET_LIST_RATE = 5.0
"""Lists per second a whole fleet stays under once every VM's recheck has backed off (below RECHECK_MAX)."""
RECHECK_FLOOR, RECHECK_MAX = 10.0, 60.0
"""The longest wait between two background lists of one VM: vms / FLEET_LIST_RATE within these bounds."""
RETRY_FIRST, RETRY_MAX = 1.0, 30.0
"""Backoff after a failed store request: 1 s doubling to 30 s."""
Fetch = Callable[[str, "str | None"], bytes]
"""How the store's credential gets a token answer: (resource, client_id) -> IMDS's body; raises on failure."""


class StoreError(MaintdError):
    """One store request failed: `outcome` is the metric's label, the message says why, `retry_after` the
    seconds the store asked for before the next request (a 503 ServerBusy or 429 with Retry-After)."""

    def __init__(self, outcome: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.retry_after = retry_after


@dataclass(frozen=True)
class Unchanged:
    """A conditional read's answer when the record is still at the ETag asked about (304: no body), with the
    store's clock when it answered."""

    etag: str
    date: datetime


# --- layout --------------------------------------------------------------------------------------

def event_folder(event_id: str) -> str:
    """The prefix every blob of one event starts with."""
    return f"events/{event_id.lower()}/"


def marker_blob(event_id: str, vm: str) -> str:
    """Where a VM records itself for an event (its name lower-cased: Resources compare case-insensitively)."""
    return f"{event_folder(event_id)}vm/{vm.casefold()}"


def approval_blob(event_id: str) -> str:
    """The event's approval record."""
    return f"{event_folder(event_id)}approval"


def unstorable(event_id: str, names: Sequence[str]) -> str | None:
    """Why an event cannot be coordinated through the store (None when it can): odd ids or names."""
    if not EVENT_ID.match(event_id):
        return f"event id {event_id[:40]!r} is not a GUID-like id"
    odd = [n for n in names if not VM_NAME.match(n)]
    return f"Resources holds names the store does not take: {', '.join(n[:40] for n in odd[:3])}" if odd else None


def marker_record(event_id: str, vm: str, state: str, health: str = OK) -> dict[str, str]:
    """A VM's marker as blob metadata: its readiness, and its health as the fleet gate counts it."""
    return {"maintd": VERSION, "kind": "vm", "event": event_id.lower(), "vm": vm, "state": state, "health": health}


def approval_record(event_id: str, by: str, state: str, attempt: int) -> dict[str, str]:
    """The approval record as blob metadata."""
    return {"maintd": VERSION, "kind": "approval", "event": event_id.lower(), "by": by, "state": state,
            "attempt": str(attempt)}


# --- parsing ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    """One listed blob, as the I/O edge hands it over: whatever the answer held, so parsing may see any shape
    (a None value, a missing Last-Modified or ETag, a naive time, a type nobody expected)."""

    name: str
    metadata: Mapping[Any, Any]
    etag: str | None
    last_modified: datetime | None


@dataclass(frozen=True)
class Marker:
    vm: str
    state: str
    age: float
    health: str = OK
    etag: str = ""
    """As the listing said ("" when it said none): a VM knows the ETag of its own last write."""


@dataclass(frozen=True)
class Approval:
    """The approval record: `unreadable` when the protocol did not write it (never an approval)."""

    by: str
    state: str
    attempt: int
    etag: str
    age: float
    at: datetime | None = None
    """When it was last written, on the store's clock (Last-Modified)."""


@dataclass(frozen=True)
class Listing:
    """One event as the store holds it: markers by lower-cased VM name, the approval, what was odd.

    `problems` keeps the first MAX_PROBLEMS descriptions; `odd` counts every blob that was a problem."""

    event_id: str
    markers: Mapping[str, Marker]
    approval: Approval | None
    problems: tuple[str, ...]
    odd: int = 0


MAX_PROBLEMS = 5
"""Problems a listing describes (the rest are counted): a 50 MB answer of junk is one summary, not 80,000 lines."""


def _text(value: object, limit: int) -> str:
    """A value from the store, quoted and cut for a problem description (any type)."""
    return repr(value)[:limit] if not isinstance(value, str) else repr(value[:limit])


def _fields(metadata: object, expected: frozenset[str]) -> dict[str, str] | str:
    if not isinstance(metadata, Mapping):
        return f"metadata is {type(metadata).__name__}, not fields"
    odd = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if odd:
        return f"field {_text(odd[0], 32)} has no text value"
    fields = {k.casefold(): v for k, v in metadata.items()}
    if len(fields) != len(metadata):
        return "a field appears twice"
    if set(fields) != expected:
        extra, missing = sorted(set(fields) - expected), sorted(expected - set(fields))
        return "; ".join(x for x in (f"unknown field {', '.join(e[:32] for e in extra[:5])}" if extra else "",
                                     f"missing {', '.join(missing)}" if missing else "") if x)
    if fields["maintd"] != VERSION:
        return f"protocol version {fields['maintd'][:8]!r}, not {VERSION}"
    return fields


def parse_marker(event_id: str, path_name: str, metadata: Mapping[Any, Any], age: float,
                 etag: str = "") -> Marker | str:
    """The marker at events/{event}/vm/{path_name}, or why it does not count (metadata of any shape)."""
    fields = _fields(metadata, MARKER_FIELDS)
    if isinstance(fields, str):
        return fields
    if fields["kind"] != "vm" or fields["event"].casefold() != event_id.casefold():
        return f"kind {fields['kind'][:16]!r} for event {fields['event'][:40]!r}: not this event's marker"
    if fields["vm"].casefold() != path_name or not VM_NAME.match(fields["vm"]):
        return f"names VM {fields['vm'][:64]!r}"
    if fields["state"] not in (PREPARING, READY):
        return f"unknown state {fields['state'][:16]!r}"
    if fields["health"] not in (OK, UNHEALTHY):
        return f"unknown health {fields['health'][:16]!r}"
    return Marker(fields["vm"], fields["state"], age, fields["health"], etag)


def parse_approval(event_id: str, metadata: Mapping[Any, Any], etag: str, age: float,
                   names: frozenset[str], at: datetime | None = None) -> Approval | str:
    """The approval record, or why it is unreadable (`names`: the lower-cased Resources; metadata of any shape)."""
    fields = _fields(metadata, APPROVAL_FIELDS)
    if isinstance(fields, str):
        return fields
    if fields["kind"] != "approval" or fields["event"].casefold() != event_id.casefold():
        return f"kind {fields['kind'][:16]!r} for event {fields['event'][:40]!r}: not this event's record"
    if fields["by"].casefold() not in names:
        return f"by {fields['by'][:64]!r}, a VM the event does not name"
    if fields["state"] not in (CLAIMED, APPROVED, RELEASED):
        return f"unknown state {fields['state'][:16]!r}"
    attempt = fields["attempt"]
    if not (attempt.isascii() and attempt.isdigit() and len(attempt) <= 7 and 1 <= int(attempt) <= MAX_ATTEMPT):
        return f"attempt {attempt[:16]!r} is not a count"
    return Approval(fields["by"], fields["state"], int(attempt), etag, age, at)


def same_etag(a: str, b: str) -> bool:
    """Whether two ETags name the same version: a listing gives them bare (`0x8D...`), headers quoted."""
    return a.strip('"') == b.strip('"')


def age_of(item: Item, server_time: datetime) -> float | None:
    """Seconds since the blob was last written, on the store's own clock (never negative); None when the answer
    gave no usable Last-Modified (or no usable clock)."""
    written, now = aware_or_none(item.last_modified), aware_or_none(server_time)
    return None if written is None or now is None else max(0.0, (now - written).total_seconds())


def _parse_item(event_id: str, folder: str, item: Item, server_time: datetime,
                names: frozenset[str]) -> tuple[Marker | Approval | None, str | None]:
    """One listed blob: (what it is, or None; why it is odd, or None)."""
    if not isinstance(item.name, str):
        return None, f"a blob named {_text(item.name, 40)}"
    rest = item.name[len(folder):] if item.name.startswith(folder) else None
    etag = item.etag if isinstance(item.etag, str) else ""
    age = age_of(item, server_time)
    if rest == "approval":
        at = aware_or_none(item.last_modified)
        lacks = [what for what, missing in (("ETag", not etag), ("Last-Modified", age is None)) if missing]
        unknown = f"no {' or '.join(lacks)} in the listing, so it is not taken over" if lacks else None
        parsed = parse_approval(event_id, item.metadata, etag, age or 0.0, names, at)
        if isinstance(parsed, str):
            why = "; ".join(x for x in (parsed, unknown) if x)
            return Approval("", UNREADABLE, 0, etag, age or 0.0, at), f"approval record: {why}"
        return parsed, unknown and f"approval record: {unknown}"
    if rest is not None and rest.startswith("vm/") and rest[3:] in names:
        marker = parse_marker(event_id, rest[3:], item.metadata, age or 0.0, etag)
        return (None, f"marker {rest[3:]}: {marker}") if isinstance(marker, str) else (marker, None)
    return None, f"blob {item.name[:120]!r} is not part of the protocol for this event"


def parse_listing(event_id: str, items: Sequence[Item], server_time: datetime, resources: Sequence[str]) -> Listing:
    """What one list of an event's folder says; each odd blob is a problem, never a ready VM or an approval.

    Total: any item of any shape is parsed or described, never raised on. An approval record without a usable
    ETag or Last-Modified keeps age 0 and no ETag, so it is never taken over on that listing (only one that
    shows both can be)."""
    names = frozenset(n.casefold() for n in resources)
    folder = event_folder(event_id)
    markers: dict[str, Marker] = {}
    approval: Approval | None = None
    problems: list[str] = []
    odd = 0
    for item in items:
        parsed, problem = _parse_item(event_id, folder, item, server_time, names)
        if isinstance(parsed, Approval):
            approval = parsed
        elif isinstance(parsed, Marker):
            markers[parsed.vm.casefold()] = parsed
        if problem is not None:
            odd += 1
            if len(problems) < MAX_PROBLEMS:
                problems.append(problem)
    return Listing(event_id, markers, approval, tuple(problems), odd)


# --- decisions ----------------------------------------------------------------------------------

def not_ready(listing: Listing | None, resources: Sequence[str]) -> list[str]:
    """The VMs named in Resources without a readable `ready` marker, in Resources order."""
    markers = listing.markers if listing is not None else {}
    return [n for n in resources if (m := markers.get(n.casefold())) is None or m.state != READY]


def fleet_health(listing: Listing | None, resources: Sequence[str]) -> dict[str, str]:
    """For the fleet gate: each VM's health as its marker says (ok / unhealthy), `unreachable` without one."""
    markers = listing.markers if listing is not None else {}
    return {n: m.health if (m := markers.get(n.casefold())) is not None else UNREACHABLE for n in resources}


def vm_state(listing: Listing | None, name: str) -> str:
    """preparing, ready or `not seen` (no readable marker), for the fleet view."""
    marker = listing.markers.get(name.casefold()) if listing is not None else None
    return marker.state if marker is not None else "not seen"


@dataclass(frozen=True)
class Step:
    """What this VM does next for an event: wait, claim (create), take_over (If-Match etag), or done."""

    action: str
    reason: str
    etag: str = ""
    attempt: int = 1


def next_step(listing: Listing, resources: Sequence[str], me: str, takeover_after: float,
              need_all_ready: bool = True) -> Step:
    """The protocol's decision from one listing; the caller has already decided this VM may approve.

    Pure and total: the same inputs give the same `Step`, nothing is read or written, nothing
    raises (the listing comes from `parse_listing`, whatever the store held). Actions:

    - `done`: the record says approved (by anyone); nobody claims again.
    - `wait`: a VM named in Resources has no readable `ready` marker (unless `need_all_ready` is off:
      `immediate` by policy), or another VM's claim is younger than `takeover_after` on the store's
      clock, or the record came without an ETag (nothing to If-Match).
    - `claim`: every VM named is ready and there is no record: create it with If-None-Match: *.
    - `take_over` (`etag`, `attempt`): rewrite the record with If-Match on `etag` — a claim that did
      not become an approval within `takeover_after`, a released claim, an unreadable record of that
      age, or this VM's own earlier claim (a restart).

    So `claim`/`take_over` never come while a VM is not ready (with `need_all_ready`), and each is an
    atomic step of which only one of any number of racers wins; what follows (one POST) is
    `post_deadline`'s and the claim check's business.
    """
    approval = listing.approval
    if approval is not None and approval.state == APPROVED:
        return Step("done", f"approved by {approval.by}")
    waiting = not_ready(listing, resources) if need_all_ready else []
    if waiting:
        more = f" (+{len(waiting) - 5} more)" if len(waiting) > 5 else ""
        return Step("wait", f"waiting for {', '.join(waiting[:5])}{more}")
    if approval is None:
        return Step("claim", "every VM named is ready" if need_all_ready else "immediate by policy")
    if not approval.etag:
        return Step("wait", "the approval record came without an ETag: nothing to take it over with")
    reason = takeover_reason(approval, me, takeover_after)
    if reason is None:
        return Step("wait", f"claimed by {approval.by or 'an unreadable record'} {approval.age:.0f}s ago; "
                            f"taken over after {takeover_after:.0f}s")
    return Step("take_over", reason, approval.etag, approval.attempt + 1)


def takeover_reason(approval: Approval, me: str, takeover_after: float) -> str | None:
    """Why a record that is not an approval may be overwritten now (None: not yet)."""
    if approval.state == RELEASED:
        return f"{approval.by} released its claim"
    if approval.state == CLAIMED and approval.by.casefold() == me.casefold():
        return "renewing this VM's own earlier claim"
    if approval.age >= takeover_after:
        who = approval.by or "an unreadable record"
        return f"{who} claimed {approval.age:.0f}s ago (store time) without approving"
    return None


def post_deadline(takeover_after: float) -> float:
    """Seconds after its claim within which the claimer may still send a POST: half of `takeover_after`.

    Measured on the claimer's own monotonic clock from before its claim request, which is no later
    than the store's Last-Modified of that claim; another VM takes over only once the store says the
    claim is `takeover_after` old. Right before every send (the first and each retry) the claimer
    checks this deadline and that the store still holds its claim's ETag (`claim_still_holds`).

    That narrows the overlap to a window, it does not close it: a claimer paused (SIGSTOP, a VM
    freeze, a live migration) after its last check and before its POST reaches IMDS may send once
    more after a taker has posted, and IMDS takes no fencing token to refuse it. The window is the
    time between that check and the send, plus a freeze the monotonic clock does not count (the
    ETag read catches a takeover that landed before the check).
    """
    return takeover_after / 2


def recheck_delay(checks: int, vms: int) -> float:
    """Wait before this VM lists an event again on its own, after `checks` lists that settled nothing: from a
    quarter of the cap (at least RECHECK_FIRST) doubling to the cap, vms / FLEET_LIST_RATE within
    [RECHECK_FLOOR, RECHECK_MAX]. The last VM ready claims from its own list; these are for a takeover,
    a late operator's go, or a claimer that failed, so a large fleet need not look often."""
    cap = min(RECHECK_MAX, max(RECHECK_FLOOR, vms / FLEET_LIST_RATE))
    return min(cap, max(RECHECK_FIRST, cap / 4) * 2.0 ** max(0, min(checks, 16) - 1))


def takeover_check_delay(listing: Listing, me: str, takeover_after: float, vms: int, jitter: float) -> float | None:
    """When to list again to take over the claim this listing shows (None: no claim to take over).

    Right after the claim becomes `takeover_after` old, spread over vms / FLEET_LIST_RATE seconds
    (at most RECHECK_FLOOR) by `jitter` in [0, 1), so a fleet does not relist all at once.
    """
    approval = listing.approval
    if approval is None or approval.state in (APPROVED, RELEASED) or approval.by.casefold() == me.casefold():
        return None
    return max(0.0, takeover_after - approval.age) + jitter * min(RECHECK_FLOOR, vms / FLEET_LIST_RATE)


RETRY_AFTER_MAX = 300.0
"""The longest Retry-After the store may ask for (a longer one is taken as 5 minutes)."""


def retry_delay(failures: int) -> float:
    """Wait after `failures` failed store requests in a row before the next one."""
    return min(RETRY_MAX, RETRY_FIRST * 2.0 ** max(0, min(failures, 16) - 1))
