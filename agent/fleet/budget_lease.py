"""A member's own hold on its place, pure: the lease on its monotonic clock (B2), when a forced member may leave
rotation (B3), the forced line's reason, this VM's part in the budget (`Mine`, the loop's own, which gives its place
back `rejoin_wait` after it is back in rotation: B7; and `Hold`, the snapshot the approver reads) and the approval's
check with this VM counted by its own hold.

B2: a member out by choice holds its place only within its lease. The lease runs on its own monotonic clock from
`sent_at`, when it sent the read of the step whose write listed it (that read's Date is the entry's `renewed`, no
earlier than the store's time at `sent_at` to the Date's one-second resolution, so the request's duration is
inside the lease), for `release_after` less a margin for the store's Date and the two clocks' rates. Past it the
place is lost, whatever the record said when it was last read: another member may have dropped the entry.

B3: a forced member writes itself into the record before it leaves rotation whenever the store answers: it leaves
once the FORCE write landed, or the store failed, or FORCE_WAIT_S passed without an answer (the workload's safety
before the budget's count), and keeps trying the write until it lands.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from agent.coordination.store.store_protocol import StoreError
from agent.fleet.budget_rules import CHOSEN, FORCED, FORCED_AT_ONCE, Places, approval_blocked, forced_now
from agent.model.budget_gate import LeaveGate
from agent.model.timefmt import iso_z

LEASE_MARGIN_S = 2.0
"""Seconds a lease ends before the others may drop the entry: the store's Date has a one-second resolution, and
the store's clock may step."""
LEASE_MARGIN_RATE = 0.01
"""And this share of `release_after` more: the rates of the member's monotonic clock and the store's."""
FORCE_WAIT_S = 3.0
"""Seconds a forced member waits for its FORCE write to land before it leaves rotation anyway."""


def lease_margin(release_after: float) -> float:
    """What a lease keeps back of `release_after`: LEASE_MARGIN_S + LEASE_MARGIN_RATE x release_after."""
    return LEASE_MARGIN_S + LEASE_MARGIN_RATE * release_after


def lease_end(sent_at: float, renewed: datetime, date: datetime, release_after: float) -> float:
    """When a member's place ends on its own monotonic clock. `sent_at`: when it sent the read of the step; `date`:
    the store's Date of that read; `renewed`: its entry's renewal in the record the step left (`date` itself when
    the step wrote it, earlier when it only read an entry it wrote before). The others may drop the entry once the
    store's clock passes `renewed + release_after`; the member counts its place lost `lease_margin` before that."""
    age = max(0.0, (date - renewed).total_seconds())
    return sent_at + release_after - age - lease_margin(release_after)


def force_may_leave(forced_at: float, now: float, landed: bool, failed_since: bool) -> bool:
    """Whether a member forced at `forced_at` (monotonic) may leave rotation at `now`: its FORCE write `landed`
    (it is counted), the store failed since it was forced (`failed_since`: it cannot be counted yet), or
    FORCE_WAIT_S passed without an answer."""
    return landed or failed_since or now - forced_at >= FORCE_WAIT_S


def forced_by(needs: float, lead_time: float, now: datetime) -> Callable[[Want], bool]:
    """Whether a wanted event is forced at `now` (`budget_rules.forced_now` with this VM's needs and lead time)."""
    return lambda w: forced_now(w.event_type, w.not_before, needs, lead_time, now)


def forced_reason(event_type: str, not_before: datetime | None) -> str:
    """The `budget.forced` line's reason: why this member leaves rotation over budget."""
    if event_type in FORCED_AT_ONCE:
        return f"{event_type}: at once (its notice is too short to wait for a place)"
    if not_before is None:
        return "the event has no NotBefore: at once"
    return "no place by its last safe moment: out over budget (safety before capacity)"


@dataclass(frozen=True)
class Want:
    """A pending event naming this VM whose preparation is due (its plan says so)."""

    event_id: str
    event_type: str
    not_before: datetime | None
    committed: bool = False
    """The platform acts on it now: it is Started, or its approval was sent or ordered by an operator (B2: a lost
    place for it keeps the VM out, forced, never returns it to rotation)."""


@dataclass(frozen=True)
class Hold:
    """This VM's own place as the loop last saw it (an immutable snapshot: the approver's thread reads it)."""

    why: str | None = None
    event: str = ""
    lease_end: float = float("-inf")
    forced: frozenset[str] = frozenset()

    def holds(self, event_id: str, now: float) -> bool:
        """Whether this VM may count itself out for `event_id` at `now`: forced, or a place within its lease."""
        return event_id in self.forced or (self.event == event_id and (
            self.why == FORCED or (self.why == CHOSEN and now < self.lease_end)))


@dataclass
class Mine:
    """This VM's part in the budget (the loop's own: `budget.Budget` keeps it, these methods change it)."""

    why: str | None = None
    event: str = ""
    since: float | None = None
    waiting_since: float | None = None
    waiting_for: str = ""
    busy: bool = False
    due: float = float("-inf")
    woken: float = float("-inf")
    """When the last read a wake hint asked for was due (hints cause at most one read per WAKE_GAP)."""
    renew_at: float = float("inf")
    look: bool = False
    """The coordinator waits on other members' places: read the record again soon."""
    failures: int = 0
    error: StoreError | None = None
    failed_at: float = float("-inf")
    """When the last step failed (monotonic)."""
    lease_end: float = float("-inf")
    """B2: a place by choice is held until then, on this VM's monotonic clock."""
    forced: dict[str, float] = field(default_factory=dict)
    """B3: the events this VM is forced out for, and since when (monotonic); kept until it releases."""
    known: dict[str, Want] = field(default_factory=dict)
    """The events it asked a place for (their type and NotBefore), kept until it releases."""
    lost: frozenset[str] = frozenset()
    """Events whose place was lost: they return to rotation (the gate revokes them) until seated again."""
    lost_reason: str = ""
    reasons: dict[str, str] = field(default_factory=dict)
    out_seen: bool = False
    """It was out of rotation while it held a place or was forced (or a start found its place held)."""
    back_since: float | None = None
    """When it came back into rotation after that (monotonic): it keeps its place `rejoin_wait` more (B7)."""

    def seat(self, why: str, event: str, now: float, lease: float) -> None:
        """A step of its own listed it as a holder (chosen or forced) for `event`, held until `lease`."""
        self.why, self.event, self.since, self.lease_end = why, event, now, lease
        self.lost, self.lost_reason, self.waiting_since = self.lost - {event}, "", None

    def clear(self) -> None:
        """Released: nothing held, waited for, forced or lost any more."""
        self.why, self.event, self.since, self.renew_at, self.lease_end = None, "", None, float("inf"), float("-inf")
        self.waiting_since, self.waiting_for, self.lost, self.lost_reason = None, "", frozenset(), ""
        self.forced, self.known = {}, {}
        self.out_seen, self.back_since = False, None

    def rejoin(self, out: bool, now: float) -> bool:
        """Follow this VM's rotation while it counts in the budget; True when it just came back into rotation."""
        if out:
            self.out_seen = self.out_seen or self.why is not None or bool(self.forced)
            self.back_since = None
            return False
        if self.out_seen and self.back_since is None:
            self.back_since = now
            return True
        return False

    def release_due(self, rejoin_wait: float) -> float:
        """When it may release its place (monotonic). B7: a member back in rotation keeps it `rejoin_wait` more,
        the load balancer's time to send it traffic again (as many good answers as it took bad ones to stop);
        one that never left rotation releases at once."""
        if not self.out_seen:
            return float("-inf")
        return float("inf") if self.back_since is None else self.back_since + rejoin_wait

    def note(self, wants: Sequence[Want], started: Sequence[Want], now: float, forced: Callable[[Want], bool]) \
            -> list[Want]:
        """Remember the events asked for and the ones it is out for; the wanted ones `forced` now that were not (B3:
        kept until release, whatever their preparation does). A member without a place sends its FORCE step at
        once, ahead of any backoff; those are returned (to be said). A place lost for an event that became committed
        since (a read in flight while it turned Started) is forced now, never returned to rotation."""
        self.known.update({w.event_id: w for w in (*started, *wants)})
        for w in (w for w in started if w.committed and w.event_id in self.lost):
            self.lost, self.forced[w.event_id] = self.lost - {w.event_id}, now
        new = [w for w in wants if w.event_id not in self.forced and forced(w)]
        for w in new:
            self.forced[w.event_id] = now
        if new and self.why is None:
            self.due = min(self.due, now)
        return new if self.why is None else []

    def lose(self, now: float, forced: Callable[[Want], bool], reason: str, event: str) -> bool:
        """B2: its place for `event` is gone. When the event is forced (its last safe moment has come) or committed
        (Started, approved: the platform acts now) it stays out as forced (B3: True); else the event returns to
        rotation. Either way it asks again at once."""
        want = self.known.get(event)
        stays = event in self.forced or (want is not None and (want.committed or forced(want)))
        if stays:
            self.forced.setdefault(event, now)
        else:
            self.lost, self.lost_reason = self.lost | {event}, reason
            self.out_seen, self.back_since = bool(self.forced), None  # no place left to keep for the balancer
        if event == self.event:
            self.why, self.event, self.since, self.renew_at = None, "", None, float("inf")
            self.lease_end = float("-inf")
        self.waiting_since, self.waiting_for, self.due = now, event, min(self.due, now)
        return stays

    def lost_view(self, lost_at: Mapping[str, datetime]) -> list[dict[str, str | None]]:
        """The places it lost, as `/v1/fleet` shows them (`lost_at`: when, by event)."""
        return [{"event_id": e, "reason": self.lost_reason, "at": iso_z(lost_at[e]) if e in lost_at else None}
                for e in sorted(self.lost)]

    def gate(self, wants: Sequence[Want], now: float) -> LeaveGate:
        """Which due events may leave rotation now (a place held, or forced and `force_may_leave`), and which must
        return to it (a place lost)."""
        if self.why is not None:
            allowed = frozenset(w.event_id for w in wants)
        else:
            allowed = frozenset(e for e, at in self.forced.items()
                                if force_may_leave(at, now, False, self.failed_at >= at))
        allowed -= self.lost
        for eid in allowed:
            self.reasons.setdefault(eid, self.why or FORCED)
        return LeaveGate(True, allowed, self.lost)

    def hold(self) -> Hold:
        return Hold(self.why, self.event, self.lease_end, frozenset(self.forced))

    def deadline(self, now: float, rejoin_wait: float) -> float:
        """The first of what is due after `now` (inf: nothing): a place's lease end (B2: lost on time), its renewal,
        the next step (a waiter's poll, a retry; none while one is in flight), its release after `rejoin_wait` (B7).
        The loop's sleep ends by it, whatever the poll interval or the IMDS backoff."""
        times = [] if self.busy else [self.due, self.release_due(rejoin_wait)]
        if self.why is not None:
            times.append(self.renew_at)
        if self.why == CHOSEN:
            times.append(self.lease_end)
        return min((t for t in times if t > now), default=float("inf"))


def approval_held(resources: Sequence[str], event_id: str, places: Places | None, me: str, hold: Hold,
                  now: float) -> str | None:
    """Why an event may not be approved early yet (None: it may): `budget_rules.approval_blocked`, with this VM
    (`me`) counted by its own `hold` at `now` (its lease, its forced state: B2, B3), never by the record it last
    read, which may still list a place it lost."""
    mine = me.casefold()
    here = frozenset({mine}) if hold.holds(event_id, now) else frozenset()
    others = None if places is None else replace(
        places, holders=tuple(h for h in places.holders if h.vm.casefold() != mine))
    return approval_blocked(resources, event_id, others, here)


def send_held(resources: Sequence[str], event_id: str, me: str, hold: Hold, now: float) -> str | None:
    """The approver's recheck immediately before every send: None unless `me` is named and no longer holds its
    place for the event within its lease (nor is forced)."""
    if me.casefold() not in {r.casefold() for r in resources} or hold.holds(event_id, now):
        return None
    return f"budget: this VM no longer holds its place for {event_id} (its lease ended or it was dropped)"


def health_words(m: Mine, group: str | None, wants: Sequence[Want], store: str) -> tuple[str, str]:
    """The `coordination`/`budget` health report: (ok | warning, what it says)."""
    if m.lost:
        return "warning", (f"lost its place in budget {group} for {', '.join(sorted(m.lost))}: {m.lost_reason}; "
                           "back in rotation, queued again")
    if m.why is None and wants and not m.forced:
        failing = f"; the store ({store}) fails: {m.error}" if m.error else ""
        return "warning", (f"waiting for a place in budget {group or '(no group)'} for {wants[0].event_id}{failing}; "
                           "prepares at its last safe moment")
    if m.back_since is not None and (m.why or m.forced):
        return "ok", (f"budget {group}: back in rotation; keeps its place ({m.why or FORCED}) for rejoin_wait, until "
                      "the load balancer can send it traffic again")
    return "ok", f"budget {group}: " + (f"holds a place ({m.why})" if m.why else "idle")
