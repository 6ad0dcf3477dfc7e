"""A disruption budget through the blob store, pure: the places record, its parsing, and every decision.

One record per group, `budget/{group}/places`, a small JSON body created with If-None-Match: * and
rewritten only with If-Match: <ETag>. Every change of who is out — a member taking a place, being
forced, queueing, renewing, releasing — is a compare-and-swap on that one record, so the count and
the spread are checked against the whole set at once and no race can seat more than
`max_unavailable` members by choice:

    {"maintd": 1, "kind": "places", "group": "web",
     "holders": [{"vm", "zone", "fault_domain", "event", "why": "chosen" | "forced", "since", "renewed", "url"}],
     "waiting": [{"vm", "zone", "fault_domain", "event", "why": "waiting", "since", "renewed", "url"}],
     "members": {"vm": "seen"}}

Every instant in it is the store's own clock (the Date of the answer the writer last read), so an age is
always the store's Date minus a time the store gave: no VM compares its clock with another's. A holder
or waiter that has not renewed for `release_after` is dropped by whoever writes the record next (a VM
that never came back). Parsing is total: a record of any shape is a `Places` or a reason, never an
exception; an unreadable record is never taken as free places (a VM waits as if the store were down).

Handoff: every write hands the places it leaves free to the waiters first in line that may go (`grant`, with
the same count and spread as a `take`), so a release seats the next member in the releaser's own write. A
granted waiter is a holder from that write on (out for everyone else) even before it notices, and leaves
rotation only once a TAKE of its own rewrote its entry (B1: out by choice only on a write it made); its entry's
`url` (optional, `coordination.budget.advertise`) is shown in the fleet view and never used: a wake hint goes to
the address the writer's own configuration derives for the member's name (B5). The hint carries no authority: a
member acts only on what it reads here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Final, Literal

from agent.model.timefmt import instant_or_none, iso_z

Why = Literal["chosen", "forced", "waiting"]
"""Why a member is listed: out by maintd's choice, out over budget (the platform's deadline), or waiting."""
CHOSEN: Final = "chosen"
FORCED: Final = "forced"
WAITING: Final = "waiting"
WHYS: tuple[Why, Why] = (CHOSEN, FORCED)
SPREADS = ("none", "zone", "fault_domain")
Action = Literal["take", "force", "release", "renew", "read"]
"""What a member asks of the record in one step (`apply_step`)."""
TAKE: Final = "take"
FORCE: Final = "force"
RELEASE: Final = "release"
RENEW: Final = "renew"
READ: Final = "read"
FORCED_AT_ONCE = frozenset({"Preempt", "Terminate"})
"""Event types whose notice is too short to wait: out at once, over budget if need be."""
MEMBER_TTL = 3600.0
"""Seconds a member's stamp counts it among the group's members (`coordination.budget.member_ttl`'s default: B5,
a percentage is taken over members that wrote within it; each refreshes its stamp every third of it)."""
MAX_BODY = 512 * 1024
MAX_ENTRIES = 5000
FORCE_MARGIN = 5.0
"""Seconds a forced member starts before what its preparation needs: the loop's and the store's own steps."""
URL_PATTERN = re.compile(r"^https?://[^\s/?#]{1,200}$")
"""A member's advertised API, shown only: scheme and authority (anything else is shown as none)."""


def places_blob(group: str) -> str:
    return f"budget/{group.casefold()}/places"


@dataclass(frozen=True)
class Entry:
    """One member listed in the record: a holder (chosen, forced) or a waiter."""

    vm: str
    zone: str
    fault_domain: str
    event: str
    why: Why
    since: datetime
    renewed: datetime
    url: str = ""
    """What the member advertised ("" none): shown in the fleet view, never an address anything is sent to."""

    def to_json(self) -> dict[str, str]:
        return {"vm": self.vm, "zone": self.zone, "fault_domain": self.fault_domain, "event": self.event,
                "why": self.why, "since": iso_z(self.since), "renewed": iso_z(self.renewed),
                **({"url": self.url} if self.url else {})}


@dataclass(frozen=True)
class Places:
    """The group as the record says: who is out, who waits (first come first), which members are known."""

    holders: tuple[Entry, ...] = ()
    waiting: tuple[Entry, ...] = ()
    members: Mapping[str, datetime] = field(default_factory=dict)

    def holder(self, vm: str) -> Entry | None:
        return next((h for h in self.holders if h.vm.casefold() == vm.casefold()), None)

    def waiter(self, vm: str) -> Entry | None:
        return next((w for w in self.waiting if w.vm.casefold() == vm.casefold()), None)


@dataclass(frozen=True)
class Me:
    """This member as the budget sees it: its name and topology (IMDS compute zone and platformFaultDomain)."""

    vm: str
    zone: str = ""
    fault_domain: str = ""
    url: str = ""
    """What it writes as its `url` (`advertise`, "" none): shown in the fleet view only."""


# --- the record ------------------------------------------------------------------------------------

def _entry(raw: object, holder: bool) -> Entry | str:
    if not isinstance(raw, dict):
        return f"an entry is {type(raw).__name__}, not a mapping"
    values = {k: raw.get(k) for k in ("vm", "zone", "fault_domain", "event", "why", "since", "renewed")}
    if not all(isinstance(v, str) for v in values.values()) or not values["vm"]:
        return "an entry lacks a text field"
    allowed: tuple[str, ...] = (CHOSEN, FORCED) if holder else (WAITING,)
    if values["why"] not in allowed:
        return f"an entry says why {str(values['why'])[:16]!r}"
    since, renewed = instant_or_none(values["since"]), instant_or_none(values["renewed"])
    if since is None or renewed is None:
        return "an entry has no readable instant"
    why = WHYS[allowed.index(str(values["why"]))] if holder else WAITING
    url = raw.get("url")
    return Entry(str(values["vm"])[:128], str(values["zone"])[:32], str(values["fault_domain"])[:32],
                 str(values["event"])[:128], why, since, renewed,
                 url if isinstance(url, str) and URL_PATTERN.match(url) else "")


def parse_places(body: bytes) -> Places | str:
    """The record, or why it is unreadable (any bytes: never raises)."""
    if len(body) > MAX_BODY:
        return f"record over {MAX_BODY // 1024} KiB"
    try:
        doc: Any = json.loads(body)
    except (ValueError, RecursionError):
        return "record is not JSON"
    if not isinstance(doc, dict) or doc.get("maintd") != 1 or doc.get("kind") != "places":
        return "record is not a maintd places record"
    holders, waiting, members = doc.get("holders"), doc.get("waiting"), doc.get("members")
    if not isinstance(holders, list) or not isinstance(waiting, list) or not isinstance(members, dict) \
            or len(holders) + len(waiting) + len(members) > MAX_ENTRIES:
        return "record lacks holders, waiting or members"
    parsed: list[list[Entry]] = [[], []]
    for i, items in enumerate((holders, waiting)):
        for raw in items:
            entry = _entry(raw, holder=i == 0)
            if isinstance(entry, str):
                return entry
            parsed[i].append(entry)
    seen: dict[str, datetime] = {}
    for vm, at in members.items():
        when = instant_or_none(at)
        if not isinstance(vm, str) or when is None:
            return "a member has no readable instant"
        seen[vm[:128]] = when
    return Places(tuple(parsed[0]), tuple(parsed[1]), seen)


def render_places(group: str, places: Places) -> bytes:
    return json.dumps({"maintd": 1, "kind": "places", "group": group,
                       "holders": [h.to_json() for h in places.holders],
                       "waiting": [w.to_json() for w in places.waiting],
                       "members": {vm: iso_z(at) for vm, at in sorted(places.members.items())}},
                      separators=(",", ":")).encode()


# --- changes (each written back with If-Match) ----------------------------------------------------

def _age(at: datetime, now: datetime) -> float:
    return (now - at).total_seconds()


def live(places: Places, now: datetime, release_after: float, member_ttl: float = MEMBER_TTL) -> Places:
    """The record without members that stopped renewing `release_after` ago, and without member stamps older
    than `member_ttl` (on the store's clock): what a percentage is taken over, and what every write keeps."""
    return Places(tuple(h for h in places.holders if _age(h.renewed, now) < release_after),
                  tuple(w for w in places.waiting if _age(w.renewed, now) < release_after),
                  {vm: at for vm, at in places.members.items() if _age(at, now) < member_ttl})


def stale(places: Places, now: datetime, release_after: float) -> tuple[Entry, ...]:
    """The holders `live` drops: members that never came back."""
    return tuple(h for h in places.holders if _age(h.renewed, now) >= release_after)


def _without(entries: tuple[Entry, ...], vm: str) -> tuple[Entry, ...]:
    return tuple(e for e in entries if e.vm.casefold() != vm.casefold())


def _seen(places: Places, vm: str, now: datetime) -> dict[str, datetime]:
    return {**{k: v for k, v in places.members.items() if k.casefold() != vm.casefold()}, vm: now}


def take(places: Places, me: Me, event: str, why: Why, now: datetime) -> Places:
    """`me` out for `event` (chosen or forced); a member already out keeps its first `since`."""
    held = places.holder(me.vm)
    since = held.since if held is not None else now
    keep = CHOSEN if held is not None and held.why == CHOSEN else why
    entry = Entry(me.vm, me.zone, me.fault_domain, event, keep, since, now, me.url)
    return Places(_without(places.holders, me.vm) + (entry,), _without(places.waiting, me.vm),
                  _seen(places, me.vm, now))


def queue(places: Places, me: Me, event: str, now: datetime) -> Places:
    """`me` waiting for a place (first come first: a waiter keeps its first `since`)."""
    found = places.waiter(me.vm)
    entry = Entry(me.vm, me.zone, me.fault_domain, event, WAITING, found.since if found else now, now, me.url)
    waiting = tuple(w for w in places.waiting if w.vm.casefold() != me.vm.casefold())
    return Places(_without(places.holders, me.vm), tuple(sorted(waiting + (entry,), key=lambda w: w.since)),
                  _seen(places, me.vm, now))


def release(places: Places, vm: str, now: datetime) -> Places:
    """`vm` back in rotation (or given up waiting): no longer listed."""
    return Places(_without(places.holders, vm), _without(places.waiting, vm), _seen(places, vm, now))


def register(places: Places, vm: str, now: datetime) -> Places:
    return replace(places, members=_seen(places, vm, now))


def stamped(places: Places, vm: str, now: datetime, member_ttl: float = MEMBER_TTL) -> Places:
    """The record with `vm`'s own stamp refreshed once it is a third of `member_ttl` old (or missing): a member
    stays counted while it runs, even idle (B5)."""
    at = next((t for k, t in places.members.items() if k.casefold() == vm.casefold()), None)
    return places if at is not None and _age(at, now) < member_ttl / 3 else register(places, vm, now)


def grant(places: Places, cap: int, spread: str, now: datetime) -> Places:
    """The record with its free places handed to the waiters first in line that may go (the handoff): each in
    turn (first come first) becomes a holder by choice, since `now`, when a `take` of its own would pass the
    count and the spread against the holders so far; a waiter whose zone would break the spread is skipped
    and the next one gets the place."""
    holders, waiting = list(places.holders), []
    for w in sorted(places.waiting, key=lambda e: (e.since, e.vm)):
        if _refusal(holders, w, cap, spread) is None:
            holders.append(replace(w, why=CHOSEN, since=now, renewed=now))
        else:
            waiting.append(w)
    return places if len(holders) == len(places.holders) else Places(tuple(holders), tuple(waiting), places.members)


def granted(before: Places, after: Places, vm: str) -> tuple[Entry, ...]:
    """The members other than `vm` that a write seated by handoff (holders after it that were waiting before)."""
    return tuple(h for h in after.holders if h.vm.casefold() != vm.casefold() and before.holder(h.vm) is None
                 and before.waiter(h.vm) is not None)


# --- decisions -------------------------------------------------------------------------------------

def capacity(max_unavailable: int | str, members: int) -> int:
    """Places in the budget: the count, or the percentage of the known members rounded down (at least 1)."""
    if isinstance(max_unavailable, int):
        return max(1, max_unavailable)
    percent = int(max_unavailable.rstrip("%"))
    return max(1, math.floor(percent * members / 100))


def _topology(entry: Entry | Me, spread: str) -> str:
    return entry.zone if spread == "zone" else entry.fault_domain if spread == "fault_domain" else ""


def _refusal(out: Sequence[Entry], who: Entry | Me, cap: int, spread: str) -> str | None:
    if len(out) >= cap:
        names = ", ".join(f"{h.vm} ({h.why})" for h in out[:5])
        return f"{len(out)} of {cap} place{'s' if cap != 1 else ''} held: {names}"
    if spread != "none":
        other = next((h for h in out if _topology(h, spread) != _topology(who, spread)), None)
        if other is not None:
            word = "zone" if spread == "zone" else "fault domain"
            return f"{other.vm} is out in {word} {_topology(other, spread) or '(none)'}: never two {word}s at once"
    return None


def blocked(places: Places, me: Me, cap: int, spread: str) -> str | None:
    """Why `me` may not take a place by choice now (None: it may). Counts every holder, forced ones too (they
    are out for everyone else), checks the spread against the whole set, and lets the members that waited
    longer and could go go first."""
    if places.holder(me.vm) is not None:
        return None
    out = places.holders
    why = _refusal(out, me, cap, spread)
    if why is not None:
        return why
    mine = places.waiter(me.vm)
    ahead = [w for w in places.waiting if w.vm.casefold() != me.vm.casefold()
             and (mine is None or (w.since, w.vm) < (mine.since, mine.vm)) and _refusal(out, w, cap, spread) is None]
    free = cap - len(out)
    if len(ahead) >= free:
        names = ", ".join(w.vm for w in ahead[:5])
        return f"{len(ahead)} member{'s' if len(ahead) != 1 else ''} waited longer: {names}"
    return None


def last_safe_moment(not_before: datetime, needs: float, lead_time: float) -> datetime:
    """When a member that found no place prepares anyway: NotBefore minus what its preparation needs (its drain
    wait plus its hooks' timeouts), or `prepare.lead_time` when that is longer; FORCE_MARGIN earlier still."""
    return not_before - timedelta(seconds=max(needs, lead_time) + FORCE_MARGIN)


def forced_now(event_type: str, not_before: datetime | None, needs: float, lead_time: float, now: datetime) -> bool:
    """Whether a member must leave rotation now whatever the budget: Preempt and Terminate at once, any event
    without a NotBefore, or its last safe moment has come."""
    if event_type in FORCED_AT_ONCE or not_before is None:
        return True
    return now >= last_safe_moment(not_before, needs, lead_time)


def approval_blocked(resources: Sequence[str], event: str, places: Places | None, forced_here: frozenset[str]) \
        -> str | None:
    """Why an event may not be approved early yet (None: it may): every member it names must hold a place for
    it or be forced. `forced_here`: members known forced without the record (this VM, when the store is down)."""
    missing = [n for n in resources if n.casefold() not in forced_here and not (
        places is not None and (h := places.holder(n)) is not None and h.event.casefold() == event.casefold())]
    if not missing:
        return None
    more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
    return f"budget: waiting for {', '.join(missing[:5])}{more} to hold a place or be forced"


def counts(places: Places) -> dict[str, int]:
    """maintd_budget_members{state}: out by choice, forced, waiting."""
    return {"out": sum(1 for h in places.holders if h.why == CHOSEN),
            "forced": sum(1 for h in places.holders if h.why == FORCED), "waiting": len(places.waiting)}


def apply_step(places: Places, action: Action, me: Me, event: str, cap: int, spread: str, now: datetime,
               renew_after: float = 0.0) -> tuple[str, str, Places]:
    """One member's step on the (live) record: (what it came to, why, the record to write back with If-Match).

    take: `acquired` when `blocked` says nothing or a release handed it the place (confirmed by this step's own
    write: B1), else `waiting` (queued, first come first); force: `forced` (never refused: the platform's
    deadline); release: `released`; renew: `renewed` (a holder's renewal), or `lost` when the record no longer
    lists it (dropped after release_after: B2, never "renewed"); read: `read` (registered among the members if it
    was not). A waiter already queued for the event is written again only once its entry is `renew_after` old: a
    waiting member's polls are reads. Whatever the step, the record written back hands its free places to the
    waiters first in line (`grant`): the releaser's own write seats the next member."""
    result, why, new = _decide(places, action, me, event, cap, spread, now, renew_after)
    new = grant(new, cap, spread, now)
    if result == "waiting" and (held := new.holder(me.vm)) is not None and held.why == CHOSEN:
        return "acquired", "a place was free (first in line)", new
    return result, why, new


def _decide(places: Places, action: Action, me: Me, event: str, cap: int, spread: str, now: datetime,
            renew_after: float) -> tuple[str, str, Places]:
    held = places.holder(me.vm)
    if action == FORCE and held is not None and held.why == CHOSEN:  # handed a place it had not noticed yet
        return "acquired", "a member's release handed it the place", take(places, me, event, CHOSEN, now)
    if action == FORCE:
        return "forced", "its last safe moment came without a place", take(places, me, event, FORCED, now)
    if action == TAKE:
        if held is not None and held.event == event:  # handed the place by another's write: confirm it (B1)
            return "acquired", "a member's release handed it the place", take(places, me, event, held.why, now)
        why = blocked(places, me, cap, spread)
        if why is None:
            return "acquired", "a place was free", take(places, me, event, CHOSEN, now)
        queued = places.waiter(me.vm)
        if queued is not None and queued.event == event and _age(queued.renewed, now) < renew_after:
            return "waiting", why, places
        return "waiting", why, queue(places, me, event, now)
    if action == RELEASE:
        return "released", "back in rotation", release(places, me.vm, now)
    if action == RENEW:
        if held is None or held.event.casefold() != event.casefold():
            return "lost", "its entry is no longer in the record (dropped after release_after without a renewal)", \
                places
        return "renewed", "still out", take(places, me, held.event, held.why, now)
    return "read", "", places if me.vm in places.members else register(places, me.vm, now)


def places_view(places: Places) -> dict[str, list[dict[str, str | None]]]:
    """The holders and the waiting line as `/v1/fleet` and `maintd fleet` show them."""
    return {"holders": [{"vm": h.vm, "since": iso_z(h.since), "why": h.why, "event_id": h.event, "zone": h.zone,
                         "fault_domain": h.fault_domain, "url": h.url or None} for h in places.holders],
            "waiting": [{"vm": w.vm, "since": iso_z(w.since), "event_id": w.event, "zone": w.zone,
                         "url": w.url or None} for w in places.waiting]}
