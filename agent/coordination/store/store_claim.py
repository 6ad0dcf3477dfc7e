"""The store backend's steps on the approver thread, around the POST: the claim (the atomic create or If-Match
rewrite), the check right before every send that the claim still holds, and the outcome recorded on the claim.

Each hands what it learned to the loop through `StoreExchange.hand`, as the request lanes do; only the
claims under way (event id -> `Claim`) are kept here, for `holds`, under a lock (approver threads).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from agent.coordination.store.store_exchange import OTHER, Result, Store, StoreExchange, internal_error
from agent.coordination.store.store_protocol import (
    APPROVED,
    CLAIMED,
    RELEASED,
    Approval,
    Step,
    StoreError,
    age_of,
    approval_blob,
    approval_record,
    parse_approval,
    same_etag,
)


@dataclass(frozen=True)
class Claim:
    """The approver's claim: whether this VM holds it, the record's ETag, and when the request started."""

    won: bool
    etag: str
    reason: str
    started: float
    attempt: int = 1


class StoreClaims:
    """Claim, confirm and settle for the approver thread(s); see the module docstring."""

    def __init__(self, exchange: StoreExchange) -> None:
        self.exchange = exchange
        self.clock = exchange.clock
        self.log = exchange.log
        self._held: dict[str, Claim] = {}
        self._lock = threading.Lock()

    def claim(self, event_id: str, me: str, step: Step) -> Claim:
        """On the approver thread: the atomic step (create if absent, or If-Match the record seen)."""
        started = self.clock.monotonic()
        record = approval_record(event_id, me, CLAIMED, step.attempt)
        name = approval_blob(event_id)
        try:
            store = self.exchange.store()
            etag = store.create(name, record) if step.action == "claim" else store.replace(name, record, step.etag)
            if etag is None:
                etag = self._own_after_conflict(store, event_id, me, step.attempt)
        except Exception as exc:
            error = self._as_store_error(exc, event_id, "claim")
            self.exchange.hand(Result(event_id, self.clock.monotonic(), sync=False, error=error))
            return Claim(False, "", str(error), started)
        if etag is None:  # someone else won: block a second try until a fresh listing says who
            lost = Approval(OTHER, CLAIMED, step.attempt, "", 0.0)
            self.exchange.hand(Result(event_id, self.clock.monotonic(), sync=False, approval=lost, relist=True))
            return Claim(False, "", "another VM claimed it first", started)
        mine = Approval(me, CLAIMED, step.attempt, etag, 0.0)
        self.exchange.hand(Result(event_id, self.clock.monotonic(), sync=False, approval=mine))
        return Claim(True, etag, step.reason, started, step.attempt)

    @staticmethod
    def _own_after_conflict(store: Store, event_id: str, me: str, attempt: int) -> str | None:
        """After a 409/412: the record's ETag if it is this VM's claim of this attempt (the SDK retried our own
        success), else None."""
        found = store.read(approval_blob(event_id))
        if found is None:
            return None
        record = parse_approval(event_id, found[0], found[1], 0.0, frozenset({me.casefold()}))
        return found[1] if isinstance(record, Approval) and record.state == CLAIMED and record.attempt == attempt \
            else None

    def hold(self, event_id: str, claim: Claim) -> None:
        """While the approver posts under `claim` (from the claim until `let_go`): `holds` checks it."""
        with self._lock:
            self._held[event_id] = claim

    def let_go(self, event_id: str) -> None:
        """The approver's sends under the event's claim are over."""
        with self._lock:
            self._held.pop(event_id, None)

    def holds(self, event_id: str, within: float) -> str | None:
        """On the approver thread, right before a send: None while this VM's claim still holds, else why not.

        It holds while the claim is younger than `within` on this VM's monotonic clock (checked before and after
        the request) and the store still has the record at the ETag this VM's claim wrote, younger than `within`
        on the store's own clock too (one listing of the record: its Last-Modified against the answer's Date). A
        taker must have rewritten the record before it may POST, and may take it over only once it is
        `takeover_after` old by the store's clock: that clock is the one a pause this VM's monotonic clock did not
        count (a suspend, a frozen guest) cannot fool. A store that does not answer is no confirmation."""
        with self._lock:
            claim = self._held.get(event_id)
        if claim is None:
            return "this VM holds no claim on the event"
        if (why := self._past(claim, within)) is not None:
            return why
        name = approval_blob(event_id)
        try:
            items, date = self.exchange.store().list_folder(name)
        except Exception as exc:
            return f"cannot confirm the claim: {self._as_store_error(exc, event_id, 'confirm')}"
        found = next((item for item in items if item.name == name), None)
        if found is None:
            return "the approval record is gone from the store"
        if not isinstance(found.etag, str) or not same_etag(found.etag, claim.etag):
            return "the approval record changed since this VM claimed it: another VM took the claim over"
        if (age := age_of(found, date)) is None or age >= within:
            return (f"the claim is {'of unknown age' if age is None else f'{age:.0f}s old'} on the store's clock, "
                    f"past {within:.1f}s (half of takeover_after): another VM may take it over")
        return self._past(claim, within)

    def _past(self, claim: Claim, within: float) -> str | None:
        age = self.clock.monotonic() - claim.started
        return None if age < within else \
            f"claimed {age:.1f}s ago, past {within:.1f}s (half of takeover_after): another VM may take it over"

    def _as_store_error(self, exc: Exception, event_id: str, op: str) -> StoreError:
        if isinstance(exc, StoreError):
            return exc
        self.log.error("store.internal_error", event_id=event_id, op=op, error=repr(exc)[:500], exc_info=True)
        self.exchange.count_error()
        return internal_error(exc)

    def settle(self, event_id: str, me: str, claim: Claim, approved: bool) -> bool:
        """On the approver thread, after the POST: record `approved` (or `released` after a failed POST)
        with If-Match on this VM's claim; False when the claim was taken over meanwhile or the store failed."""
        state = APPROVED if approved else RELEASED
        try:
            record = approval_record(event_id, me, state, claim.attempt)
            etag = self.exchange.store().replace(approval_blob(event_id), record, claim.etag)
        except Exception as exc:
            error = self._as_store_error(exc, event_id, "settle")
            self.exchange.hand(Result(event_id, self.clock.monotonic(), sync=False, error=error))
            return False
        if etag is None:
            self.log.warning("store.claim_taken_over", event_id=event_id, state=state,
                             reason="another VM took the claim over before this VM recorded the outcome")
            return False
        settled = Approval(me, state, claim.attempt, etag, 0.0, self.clock.now())
        self.exchange.hand(Result(event_id, self.clock.monotonic(), sync=False, approval=settled))
        return True
