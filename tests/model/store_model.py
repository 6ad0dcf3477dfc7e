"""The store backend as a model: three VMs, one blob container, one of them claims and approves.

What each step calls of the real code:
- the records: `store_protocol.marker_record` / `approval_record` build the blobs' metadata, and each
  listing is read back through `parse_listing` (Items with ETags and Last-Modified, the store's Date);
- what a VM does next: `store_protocol.next_step` and `not_ready` on that listing, then
  `approval_policy.decide`, with the coordinator tick's rule around it (only a claim or a takeover
  approves; a failed POST waits RETRY_FAILED_AFTER);
- a claim that meets a conflict: the real `StoreExchange._own_after_conflict` (reading the record back);
- how long the claimer may POST: `post_deadline`, as `StoreBackend.take_right` applies it, and when
  the POST's retries give up: the real `agent.retry.retrying` on the model's clock.

Besides S1 and S2 it checks the claim fence: no VM POSTs under a claim the store's record no longer holds (what
the recheck's read of the record is for; S2 rests on it only when the claimer's monotonic clock lies, the `FREEZE`
fault, run on its own).

The store is exact about what matters here: create with If-None-Match, replace with If-Match, ETags
and Last-Modified on the store's clock. Abstracted away: the listing cadence (a VM that may claim lists
in every turn of its loop), throttling, the markers' own failures (a lost marker write is written
again), the fleet gate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, NamedTuple

from agent.coordination.coordinator import CLAIMS, RETRY_FAILED_AFTER, Coordinator
from agent.coordination.store.store_backend import StoreBackend
from agent.coordination.store.store_claim import Claim, StoreClaims
from agent.coordination.store.store_protocol import (
    APPROVED,
    CLAIMED,
    PREPARING,
    READY,
    RELEASED,
    Item,
    Listing,
    Step,
    approval_blob,
    approval_record,
    marker_blob,
    marker_record,
    next_step,
    not_ready,
    parse_listing,
    post_deadline,
)
from agent.model.approval import AUTO, FAILED, SENDING, SENT
from agent.model.events import SCHEDULED
from agent.policy.approval_policy import decide
from tests.model.common import (
    CRASH,
    DOWN,
    EVENT_ID,
    FREEZE,
    FROZEN,
    LOST_ANSWER,
    LOST_MESSAGE,
    MAX_FAULTS,
    NOW,
    ODD_RECORD,
    PAUSE,
    PAUSED,
    POST_ERROR,
    RESTART,
    SETTINGS,
    TAKEOVER,
    TICK,
    TIME_PASSES,
    UP,
    VMS,
    Imds,
    ModelClock,
    at,
    imds_steps,
    lapsed,
    older,
    order,
    post_outcomes,
    retry_refuses,
    retry_stops,
    s1,
    s2,
    spend,
)

KINDS = (CRASH, PAUSE, LOST_ANSWER, LOST_MESSAGE, ODD_RECORD, RESTART, POST_ERROR)
"""The faults under which S1 and S2 hold. `FREEZE` (a pause the claimer's monotonic clock does not count) runs on
its own: there S2 does not hold (test_model_check, the xfail), the claim fence does."""
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
ODD_MARKER = "odd"
ODD_SHAPES = ("attempt listed back as None", "no Last-Modified", "attempt 'x'")
"""How the odd approval record is odd (each a record a VM can list: the issue's findings and garbage)."""


class Record(NamedTuple):
    """The approval blob: its metadata fields (or an odd shape), ETag (a write count) and age in ticks."""

    by: str
    state: str
    attempt: int
    etag: int
    age: int = 0
    odd: str = ""


class Vm(NamedTuple):
    run: str = UP
    prepared: bool = False
    written: str | None = None
    """The marker this VM believes it wrote (its memory; the store holds what is there)."""
    approver: tuple[Any, ...] | None = None
    """("claim", action, etag, attempt, decided) | ("claimed", etag, attempt, claimed, decided) | ("post", etag,
    attempt, claimed, decided, retries began, within, attempts) | ("settle", etag, attempt, sent); the ages in ticks:
    since the decision, the claim, the POST's first try."""
    record: str | None = None
    failed_age: int | None = None
    seen: str = SCHEDULED


class State(NamedTuple):
    vms: tuple[Vm, ...]
    markers: tuple[str | None, ...]
    approval: Record | None
    writes: int
    imds: Imds
    faults: tuple[str, ...]
    raised: str | None = None
    stale: str | None = None
    """A POST sent under a claim the store's record no longer held (the claim fence broken)."""


def _items(markers: tuple[str | None, ...], approval: Record | None) -> list[Item]:
    now = EPOCH + timedelta(seconds=NOW)
    items = []
    for name, m in zip(VMS, markers, strict=True):
        if m is not None:
            meta = marker_record(EVENT_ID, name, m) if m != ODD_MARKER else \
                {**marker_record(EVENT_ID, name, READY), "state": "almost"}
            items.append(Item(marker_blob(EVENT_ID, name), meta, f"m-{name}", now))
    if approval is not None:
        items.append(_item(approval, quoted=False))
    return items


def _item(r: Record, quoted: bool) -> Item:
    """The approval blob as the store hands it over: ETags bare in a listing, quoted in a read's answer (as Azure
    and Azurite give them)."""
    meta: dict[str, Any] = approval_record(EVENT_ID, r.by, r.state, r.attempt)
    modified: datetime | None = EPOCH + timedelta(seconds=at(r.age) or 0.0)
    if r.odd == ODD_SHAPES[0]:
        meta["attempt"] = None
    elif r.odd == ODD_SHAPES[1]:
        modified = None
    elif r.odd == ODD_SHAPES[2]:
        meta["attempt"] = "x"
    etag = f'"e{r.etag}"' if quoted else f"e{r.etag}"
    return Item(approval_blob(EVENT_ID), meta, etag, modified)


@functools.cache
def read_listing(markers: tuple[str | None, ...], approval: Record | None) -> Listing | str:
    """A listing of the store through the real parser (the string: what the parser raised)."""
    try:
        return parse_listing(EVENT_ID, _items(markers, approval), EPOCH + timedelta(seconds=NOW), VMS)
    except Exception as exc:  # the finding: a record of some shape raises instead of being a problem
        return f"parse_listing raised {type(exc).__name__}: {exc}"


def etag_number(etag: str) -> int:
    return int(etag.strip('"e')) if etag.strip('"e').isdigit() else -1


@functools.cache
def decision(i: int, v: Vm, listed: tuple[tuple[str | None, ...], Record | None] | None) -> tuple[str, Vm]:
    """The coordinator's tick for this VM on the store backend, on what it listed in this turn (see the module
    docstring)."""
    listing = None if listed is None else read_listing(*listed)
    if v.approver is not None or v.record == SENT or v.seen != SCHEDULED or not isinstance(listing, Listing):
        return "", v
    waiting = [n for n in not_ready(listing, VMS) if n != VMS[i]]
    step = next_step(listing, VMS, VMS[i], TAKEOVER)
    d = decide(mode=AUTO, status=v.seen, already_sent=v.record == SENT, manual_requested=False,
               local_pending=[], peers_not_ready=waiting, lower_ranked_reachable=[], dry_run=False)
    if not d.approve or step.action not in CLAIMS:
        return f"; waits ({step.reason if d.approve else d.reason})", v
    if v.failed_age is not None and NOW - (at(v.failed_age) or 0.0) < RETRY_FAILED_AFTER:
        return "; waits to retry", v
    return f"; {step.action} ({step.reason})", v._replace(approver=("claim", step.action, etag_number(step.etag),
                                                                    step.attempt, 0))


class _ReadBack:
    """The store as `_own_after_conflict` and the claim check read it: the approval record now."""

    def __init__(self, record: Record | None) -> None:
        self.record = record

    def read(self, name: str) -> tuple[dict[str, str], str] | None:
        if self.record is None:
            return None
        item = _item(self.record, quoted=True)
        return dict(item.metadata), item.etag or ""

    def list_folder(self, prefix: str) -> tuple[list[Item], datetime]:
        """The claim check's listing of the record: its Last-Modified and the store's clock now."""
        return ([] if self.record is None else [_item(self.record, quoted=False)]), EPOCH + timedelta(seconds=NOW)


@functools.cache
def withheld(i: int, seen: str, decided: int, claimed: int, started: int, within: float, etag: int,
             record: Record | None) -> str | None:
    """Why the real approver withholds the POST right before a send (`Approver.lapsed`: the deadlines, the
    coordinator's `still_right` on this VM's last poll, `StoreBackend.right_to_post`: its claim check reading the
    record),
    or None: it sends."""
    coordinator = SimpleNamespace(scheduled=frozenset({EVENT_ID}) if seen == SCHEDULED else frozenset(), budget=None)
    exchange = SimpleNamespace(clock=ModelClock(), log=None, store=lambda: _ReadBack(record))
    claims = StoreClaims(exchange)  # type: ignore[arg-type]
    claims._held[EVENT_ID] = Claim(True, f'"e{etag}"', "claimed", at(claimed) or 0.0)
    backend = SimpleNamespace(claims=claims, takeover_after=lambda: TAKEOVER)
    backend.claim_still_holds = lambda event_id: StoreBackend.claim_still_holds(backend, event_id)  # type: ignore[arg-type]
    check = SimpleNamespace(right_to_post=lambda *args: StoreBackend.right_to_post(backend, *args))  # type: ignore[arg-type]
    return lapsed(order(VMS[i], AUTO, decided, Step("claim", "every VM named is ready")), started, within,
                  lambda o: Coordinator.still_right(coordinator, o), check)  # type: ignore[arg-type]


class StoreModel:
    """Three VMs of the store backend, one event naming them all, approval `auto`, the default configuration."""

    name = "store"

    def __init__(self, max_faults: int = MAX_FAULTS, kinds: tuple[str, ...] = KINDS) -> None:
        self.max_faults, self.kinds = max_faults, kinds
        for cached in (read_listing, decision, withheld, _older):
            cached.cache_clear()  # they remember what the real functions said: ask them afresh

    def initial(self) -> Iterable[State]:
        yield State((Vm(),) * len(VMS), (None,) * len(VMS), None, 0, Imds(), ())

    def properties(self) -> Mapping[str, Callable[[State], str | None]]:
        return {"S1": lambda s: s1(s.imds), "S2": lambda s: s2(s.imds),
                "records": lambda s: s.raised, "fence": lambda s: s.stale}

    def elapsed(self, label: str) -> float:
        return TICK if label.startswith(TIME_PASSES) else 0.0

    def describe(self, s: State) -> str:
        rec = "none" if s.approval is None else \
            f"{s.approval.state} by {s.approval.by} (attempt {s.approval.attempt}, e{s.approval.etag})" \
            + (f" odd: {s.approval.odd}" if s.approval.odd else "")
        vms = "; ".join(f"{VMS[i]} {v.run}, {'prepared' if v.prepared else 'preparing'}"
                        f"{', ' + str(v.approver[0]) if v.approver else ''}{', record ' + v.record if v.record else ''}"
                        for i, v in enumerate(s.vms))
        return (f"IMDS: {s.imds.status}, POSTs from {sorted(s.imds.posted_by)}; store: markers {list(s.markers)}, "
                f"approval {rec}; {vms}; faults {list(s.faults)}")

    def _spend(self, s: State, kind: str) -> tuple[str, ...] | None:
        return spend(s.faults, kind, self.max_faults) if kind in self.kinds else None

    def steps(self, s: State) -> Iterable[tuple[str, State]]:
        if s.imds.status != SCHEDULED and not any(v.approver and v.approver[0] != "settle" for v in s.vms):
            return  # the event started and no VM can still POST: nothing after this can break S1 or S2
        yield from ((label, s._replace(imds=imds)) for label, imds in imds_steps(s.imds))
        busy = any(v.approver is not None for v in s.vms if v.run == UP)  # its requests take seconds, not a tick
        if not busy and not (s.imds.posted_by and s.imds.status == SCHEDULED):
            yield self._time_passes(s)
        if (f := self._spend(s, ODD_RECORD)) is not None:
            if s.approval is not None:
                for shape in ODD_SHAPES:
                    odd = s.approval._replace(etag=s.writes + 1, age=0, odd=shape)
                    yield f"FAULT the approval record turns odd: {shape}", \
                        s._replace(approval=odd, writes=s.writes + 1, faults=f)
            for j, m in enumerate(s.markers):
                if m == READY:
                    yield f"FAULT {VMS[j]}'s marker turns odd (state 'almost')", \
                        s._replace(markers=_at(s.markers, j, ODD_MARKER), faults=f)
        for i, v in enumerate(s.vms):
            yield from self._faults(s, i, v)
            if v.run != UP:
                continue
            if not v.prepared:
                yield f"{VMS[i]}'s preparation ends: it is ready", _set(s, i, v._replace(prepared=True))
            yield self._turn(s, i, v)
            yield from self._approver(s, i, v)

    def _time_passes(self, s: State) -> tuple[str, State]:
        """A tick (every record one tick older, and every VM's ages but a frozen one's: its monotonic clock stands
        still), then one turn of each running VM's loop."""
        approval = s.approval and s.approval._replace(age=older(s.approval.age) or 0)
        s = s._replace(approval=approval, vms=tuple(v if v.run == FROZEN else _older(v) for v in s.vms))
        turns = []
        for i, v in enumerate(s.vms):
            if v.run == UP:
                label, s = self._turn(s, i, v)
                turns.append(label)
        return "; ".join([TIME_PASSES] + turns), s

    def _faults(self, s: State, i: int, v: Vm) -> Iterable[tuple[str, State]]:
        name = VMS[i]
        if v.run in (PAUSED, FROZEN):
            yield f"{name} resumes", _set(s, i, v._replace(run=UP))
        if v.run == DOWN:
            yield f"{name} starts again", _set(s, i, _restarted(v, s.imds.status))
        if v.run == UP and (f := self._spend(s, PAUSE)) is not None:
            yield f"FAULT {name} is paused (SIGSTOP, a VM freeze)", _set(s, i, v._replace(run=PAUSED), f)
        if v.run == UP and (f := self._spend(s, FREEZE)) is not None:
            yield f"FAULT {name} is frozen, its monotonic clock stopped (a suspend, a hypervisor freeze)", \
                _set(s, i, v._replace(run=FROZEN), f)
        if v.run != DOWN and (f := self._spend(s, CRASH)) is not None:
            yield f"FAULT {name} crashes", _set(s, i, v._replace(run=DOWN, approver=None), f)
        if v.run == UP and (f := self._spend(s, RESTART)) is not None:
            yield f"FAULT {name} restarts", _set(s, i, _restarted(v, s.imds.status), f)

    def _turn(self, s: State, i: int, v: Vm) -> tuple[str, State]:
        """One turn of this VM's loop: poll, write its marker if it changed, list (once it may claim), decide."""
        name, did = VMS[i], []
        v = v._replace(seen=s.imds.status)
        markers, listing = s.markers, None
        if v.seen == SCHEDULED and v.record != SENT:
            mark = READY if v.prepared else PREPARING
            if v.written != mark:
                markers, v = _at(markers, i, mark), v._replace(written=mark)
                did.append(f"writes its marker {mark}")
            if v.prepared:
                listing = read_listing(markers, s.approval)
                if isinstance(listing, str):
                    return f"{name} lists the event: {listing}", _set(s._replace(markers=markers, raised=listing), i, v)
                if markers[i] != v.written:
                    v = v._replace(written=None)  # the store lost its marker (or it is odd): written again next turn
                did.append("lists " + ", ".join(f"{VMS[j]} {m or '-'}" for j, m in enumerate(markers))
                           + f", approval {_show(s.approval)}")
        label, v = decision(i, v, None if listing is None else (markers, s.approval))
        return f"{name} polls{', ' + '; '.join(did) if did else ''}{label}", _set(s._replace(markers=markers), i, v)

    def _approver(self, s: State, i: int, v: Vm) -> Iterable[tuple[str, State]]:
        if v.approver is None:
            return
        kind = v.approver[0]
        if kind == "claim":
            yield from self._claim(s, i, v)
        elif kind == "claimed":
            _, etag, attempt, claimed, decided = v.approver
            left = post_deadline(TAKEOVER) - (NOW - (at(claimed) or 0.0))
            if left <= 0:
                yield f"{VMS[i]}'s claim is too old to POST", _set(s, i, v._replace(approver=("settle", etag, attempt,
                                                                                             False)))
            else:
                within = min(SETTINGS.approval_retry_for, left)
                yield f"{VMS[i]} will POST for at most {within:.0f}s", \
                    _set(s, i, v._replace(approver=("post", etag, attempt, claimed, decided, 0, within, 0)))
        elif kind == "post":
            yield from self._post(s, i, v)
        else:
            yield from self._settle(s, i, v)

    def _claim(self, s: State, i: int, v: Vm) -> Iterable[tuple[str, State]]:
        name = VMS[i]
        _, action, etag, attempt, decided = v.approver  # type: ignore[misc]
        free = s.approval is None if action == "claim" else s.approval is not None and s.approval.etag == etag
        what = "claims (If-None-Match: *)" if action == "claim" else f"takes over (If-Match: e{etag})"
        if free:
            mine = Record(name, CLAIMED, attempt, s.writes + 1)
            after = s._replace(approval=mine, writes=s.writes + 1)
            won = v._replace(approver=("claimed", mine.etag, attempt, 0, decided))
            yield f"{name} {what}: won", _set(after, i, won)
            if (f := self._spend(s, LOST_ANSWER)) is not None:
                lost = v._replace(approver=None)
                yield f"{name} {what}: FAULT it landed, the answer is lost", _set(after, i, lost, f)
        else:
            try:
                own = StoreClaims._own_after_conflict(_ReadBack(s.approval), EVENT_ID, name, attempt)  # type: ignore[arg-type]
            except Exception as exc:  # the finding: a record of some shape raises instead of being a problem
                raised = f"reading the record back after a conflict raised {type(exc).__name__}: {exc}"
                yield f"{name} {what}: conflict; {raised}", \
                    _set(s._replace(raised=raised), i, v._replace(approver=None))
                return
            if own is not None:
                yield f"{name} {what}: conflict, and the record is its own claim", \
                    _set(s, i, v._replace(approver=("claimed", etag_number(own), attempt, 0, decided)))
            else:
                yield f"{name} {what}: conflict, lost", _set(s, i, v._replace(approver=None))
        if (f := self._spend(s, LOST_MESSAGE)) is not None:
            yield f"{name} {what}: FAULT the request is lost", _set(s, i, v._replace(approver=None), f)

    def _post(self, s: State, i: int, v: Vm) -> Iterable[tuple[str, State]]:
        """The approver's next send: the real checks right before it, then the POST and what IMDS answers."""
        name = VMS[i]
        _, etag, attempt, claimed, decided, started, within, attempts = v.approver  # type: ignore[misc]
        gave_up = v._replace(approver=("settle", etag, attempt, False), record=FAILED if attempts else v.record,
                             failed_age=0)
        if attempts and retry_refuses(started, within, attempts + 1):
            yield f"{name}'s retries refuse another attempt (past their time)", _set(s, i, gave_up)
            return
        why = withheld(i, v.seen, decided, claimed, started, within, etag, s.approval)
        if why is not None:
            yield f"{name} withholds the POST: {why}", _set(s, i, gave_up)
            return
        prepared = {VMS[j]: w.prepared for j, w in enumerate(s.vms)}
        stale = s.stale or (None if s.approval is not None and s.approval.etag == etag else
                            f"{name} POSTed under its claim e{etag} while the store's record was "
                            + ("gone" if s.approval is None else f"e{s.approval.etag}, {_show(s.approval)}"))
        s = s._replace(stale=stale)
        for what, imds, faults in post_outcomes(s.imds, name, prepared, lambda kind: self._spend(s, kind)):
            if faults is None:
                after = v._replace(approver=("settle", etag, attempt, True), record=SENT, failed_age=None)
            elif retry_stops(started, within, attempts + 1):
                after = v._replace(approver=("settle", etag, attempt, False), record=FAILED, failed_age=0)
                what += "; the retries give up"
            else:
                after = v._replace(approver=("post", etag, attempt, claimed, decided, started, within, attempts + 1),
                                   record=SENDING)
            yield f"{name} POSTs StartRequests: {what}", s._replace(vms=_vms(s, i, after), imds=imds,
                                                                    faults=faults or s.faults)

    def _settle(self, s: State, i: int, v: Vm) -> Iterable[tuple[str, State]]:
        name = VMS[i]
        _, etag, attempt, sent = v.approver  # type: ignore[misc]
        state = APPROVED if sent else RELEASED
        if s.approval is not None and s.approval.etag == etag:
            rec = Record(name, state, attempt, s.writes + 1)
            yield f"{name} records {state} (If-Match: e{etag})", \
                _set(s._replace(approval=rec, writes=s.writes + 1), i, v._replace(approver=None))
        else:
            yield f"{name} records {state} (If-Match: e{etag}): taken over meanwhile", \
                _set(s, i, v._replace(approver=None))


def _show(r: Record | None) -> str:
    return "none" if r is None else f"{r.state} by {r.by} {r.age * TICK:.0f}s ago" + (f" (odd: {r.odd})" if r.odd
                                                                                     else "")


@functools.cache
def _older(v: Vm) -> Vm:
    """The VM one tick later: the ages its approver holds too."""
    a = v.approver
    if a is not None and a[0] == "claim":
        a = (*a[:4], older(a[4]))
    elif a is not None and a[0] == "claimed":
        a = (*a[:3], older(a[3]), older(a[4]))
    elif a is not None and a[0] == "post":
        a = (*a[:3], older(a[3]), older(a[4]), older(a[5]), *a[6:])
    return v._replace(approver=a, failed_age=older(v.failed_age))


def _restarted(v: Vm, status: str) -> Vm:
    """A VM after a restart: its state store (the approval record, its preparation) and a first poll, nothing else."""
    return Vm(run=UP, prepared=v.prepared, record=v.record, seen=status)


def _at(t: tuple[str | None, ...], i: int, value: str | None) -> tuple[str | None, ...]:
    return t[:i] + (value,) + t[i + 1:]


def _vms(s: State, i: int, v: Vm) -> tuple[Vm, ...]:
    return s.vms[:i] + (v,) + s.vms[i + 1:]


def _set(s: State, i: int, v: Vm, faults: tuple[str, ...] | None = None) -> State:
    return s._replace(vms=_vms(s, i, v), faults=s.faults if faults is None else faults)
