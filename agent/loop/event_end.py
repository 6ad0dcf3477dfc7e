"""When an event has ended for this VM, and its outcome for the fleet history (store backend).

One owner: the loop decides "the event ended" (it left the document, every run of it finished, the
`completed` handlers included: the VM is back in rotation) and builds an immutable `VmOutcome` from
what this VM kept in its state store: the event record (NotBefore, when it was seen Started, when
it vanished), the handlers' run records (when preparation finished, each outcome), the rotation's
record of the event's drain (out, back) and the approval this VM sent. It hands the outcome to the
history lane (`FleetHistory.write`), which records its progress under the event's `history` key in
the state store; the loop reads that key to know an event is done (or due a retry).

All of it is the store backend's: a daemon on the peers backend builds none of it and never loads the
store's modules (decision 0220), so they are imported where they are first used.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from agent.clock import Clock
from agent.health.rotation import OUT_OF_ROTATION
from agent.model.approval import APPROVAL_KEY, SENT, approved_by, has_status
from agent.model.events import STARTED, parse_event
from agent.model.outcomes import PHASE_SCHEDULED
from agent.model.timefmt import optional_iso
from agent.prepare.readiness import Readiness
from agent.prepare.run_records import RunKey
from agent.state.state_file import EventRecord
from agent.state.state_store import Store
from agent.telemetry import logs

if TYPE_CHECKING:
    from agent.coordination.store.store_exchange import Store as BlobStore
    from agent.fleet.budget import Budget
    from agent.fleet.fleet_history import FleetHistory
    from agent.fleet.history_protocol import VmOutcome

CHECK_EVERY = 2.0
"""Seconds between two looks for events that ended (the loop's tick is cheaper than this scan)."""
RECORD_WITHIN = 86400.0
"""An event that vanished longer ago than this is not recorded (events kept from before an upgrade)."""


def outcome_for(vm: str, record: EventRecord, results: dict[str, dict[str, Any]], prepared: bool,
                chosen: str | None) -> VmOutcome:
    """This VM's outcome for an event that ended, from its state store's records (ValueError, KeyError or
    TypeError on a record of the wrong shape)."""
    from agent.fleet.history_protocol import VmOutcome

    event = parse_event(record["event"])
    started = next((optional_iso(h.get("at")) for h in record.get("history", []) if h.get("status") == STARTED), None)
    runs = sorted(((key, r) for k, r in results.items() if (key := RunKey.parse(k)) is not None),
                  key=lambda run: (run[0].handler, run[0].phase))
    if prepared:
        finished = [optional_iso(r.get("finished_at")) for key, r in runs if key.phase == PHASE_SCHEDULED]
        ready_at = max((t for t in finished if t is not None), default=optional_iso(record.get("first_seen")))
    else:
        ready_at = None
    rotation = results.get(OUT_OF_ROTATION, {})
    approval = results.get(APPROVAL_KEY)
    sent = has_status(approval, SENT)
    ends = [optional_iso(record.get("vanished_at")), optional_iso(rotation.get("back_at")),
            *(optional_iso(r.get("finished_at")) for _, r in runs)]
    ended = max(t for t in ends if t is not None)
    first_seen = optional_iso(record.get("first_seen")) or ended
    not_before = event.not_before or optional_iso(record.get("not_before"))
    return VmOutcome(event_id=event.event_id, event_type=event.event_type, vm=vm, not_before=not_before,
                     out_at=optional_iso(rotation.get("out_at")), back_at=optional_iso(rotation.get("back_at")),
                     ready_at=ready_at, started_at=started,
                     approved_by=approved_by(approval),
                     approved_at=optional_iso(approval.get("at")) if sent and approval is not None else None,
                     handlers=tuple((key.handler, key.phase, str(r.get("outcome"))) for key, r in runs),
                     chosen=chosen, ended_at=ended, day=(not_before or first_seen).date())


def fleet_history(blobs: Callable[[], BlobStore] | None, store: Store, readiness: Readiness, clock: Clock,
                  count_error: Callable[[], None], group: Callable[[], str],
                  budget: Budget | None) -> tuple[FleetHistory | None, EventEnds | None]:
    """The fleet history's lane and the loop's part that feeds it, on the store backend (`blobs`); none otherwise."""
    if blobs is None:
        return None, None
    from agent.fleet.fleet_history import HISTORY_KEY, FleetHistory

    history = FleetHistory(blobs, lambda eid, value, wait: store.record(eid, HISTORY_KEY, value, wait=wait), clock,
                           count_error)
    return history, EventEnds(store, readiness, history, clock, group,
                              **({"chosen": budget.reason_for} if budget is not None else {}))


class EventEnds:
    """The loop's part: finds the events that ended for this VM and hands each outcome to the history lane once."""

    def __init__(self, store: Store, readiness: Readiness, history: FleetHistory, clock: Clock,
                 group: Callable[[], str], chosen: Callable[[str], str | None] = lambda _: None) -> None:
        self.store = store
        self.readiness = readiness
        self.history = history
        self.clock = clock
        self.group = group
        self.chosen = chosen
        self.log = logs.get("history")
        self._checked = float("-inf")
        self._sent: dict[str, int] = {}
        """Event -> the attempt this run of maintd queued last (the loop's own)."""
        self._done: set[str] = set()
        """Events this run of maintd is done with: recorded, given up, too old or unreadable (the loop's own)."""

    def tick(self, vm_name: str | None) -> None:
        """At most every CHECK_EVERY seconds: queue the outcome of each event that ended and is not recorded yet."""
        mono = self.clock.monotonic()
        if vm_name is None or mono - self._checked < CHECK_EVERY:
            return
        self._checked = mono
        from agent.fleet.fleet_history import HISTORY_KEY

        now = self.clock.now()
        records = self.store.gone_records(self._done)
        self._sent = {eid: n for eid, n in self._sent.items() if eid in records}
        for eid, rec in records.items():
            try:
                self._consider(vm_name, eid, rec, self.store.result(eid, HISTORY_KEY), now)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                self._done.add(eid)
                self.log.warning("history.unreadable_event", event_id=eid, error=f"{type(exc).__name__}: {exc}"[:300],
                                 effect="this VM records no fleet history for the event")

    def _consider(self, vm_name: str, eid: str, rec: EventRecord, note: dict[str, Any] | None,
                  now: datetime) -> None:
        from agent.fleet.fleet_history import due, finished

        vanished = optional_iso(rec.get("vanished_at"))
        if vanished is None or (now - vanished).total_seconds() > RECORD_WITHIN or finished(note):
            self._done.add(eid)  # never looked at again by this run of maintd
            return
        attempt = due(note, now, self._sent.get(eid))
        if attempt is None:
            return
        event = parse_event(rec["event"])
        if not self.readiness.finished(event, True):
            return
        outcome = outcome_for(vm_name, rec, self.store.results(eid), self.readiness.prepared(event, True),
                              self.chosen(eid))
        self._sent[eid] = attempt
        self.history.write(self.group(), outcome, attempt)
